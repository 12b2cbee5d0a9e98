"""The commands that launch no ranks are checked like those that do: a run that breaks a rule is
one line, exit code 2, and nothing is written."""

from __future__ import annotations

import pytest

from megatronapp.cli.main import main


def _cases(tmp) -> dict[str, tuple[list[str], str]]:
    (tmp / "empty").mkdir()
    (tmp / "a_file").write_text("x")
    (tmp / "folder").mkdir()
    (tmp / "notes.jsonl").write_text('{"text": "a"}\n')
    return {
        "merge, no folder": (["trace", "merge", str(tmp / "none"), "-o", str(tmp / "t.json")], "does not exist"),
        "merge, no rank files": (
            ["trace", "merge", str(tmp / "empty"), "-o", str(tmp / "t.json")],
            "no MegaScan files",
        ),
        "merge, split and window": (
            [
                "trace",
                "merge",
                str(tmp / "empty"),
                "-o",
                str(tmp / "t.json"),
                "--iterations",
                "1:3",
                "--split-iterations",
                "2",
            ],
            "--split-iterations and --iterations cannot be combined",
        ),
        "merge, split of 0": (
            ["trace", "merge", str(tmp / "empty"), "-o", str(tmp / "t.json"), "--split-iterations", "0"],
            "--split-iterations must be >= 1, got 0",
        ),
        "detect, no rank files": (["trace", "detect", str(tmp / "empty")], "no MegaScan files"),
        "whatif, no folder": (["trace", "whatif", str(tmp / "none")], "does not exist"),
        "report, no rank files": (["trace", "report", str(tmp / "empty"), "--out", str(tmp / "folder")], "no MegaScan"),
        "check, no timeline": (["trace", "check", str(tmp / "t.json")], "no such timeline file"),
        "export, no checkpoint": (["export", "hf", "--load", str(tmp / "none"), "--out", str(tmp / "hf")], "none"),
        "import, no config": (["import", "hf", "--from", str(tmp / "empty"), "--save", str(tmp / "c")], "config.json"),
        "scope report, no capture": (
            ["scope", "report", str(tmp / "c.safetensors"), "--out", str(tmp / "p")],
            "no such",
        ),
        "preprocess, folder under a file": (
            ["preprocess-data", "--input", str(tmp / "notes.jsonl"), "--output-prefix", str(tmp / "a_file" / "out")],
            "is a file, so the folder cannot be made",
        ),
    }


@pytest.mark.parametrize(
    "name",
    [
        "merge, no folder",
        "merge, no rank files",
        "merge, split and window",
        "merge, split of 0",
        "detect, no rank files",
        "whatif, no folder",
        "report, no rank files",
        "check, no timeline",
        "export, no checkpoint",
        "import, no config",
        "scope report, no capture",
        "preprocess, folder under a file",
    ],
)
def test_a_broken_command_line_is_one_line_and_writes_nothing(tmp_path, capsys, name):
    argv, message = _cases(tmp_path)[name]
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("megatronapp: error: ") and message in err[0], err
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


def test_an_output_file_must_not_be_a_folder_and_its_folder_can_be_made(tmp_path):
    from megatronapp.files import check_writable_path

    (tmp_path / "folder").mkdir()
    with pytest.raises(ValueError, match="is a folder; give a file name"):
        check_writable_path(tmp_path / "folder", "--out")
    check_writable_path(tmp_path / "new" / "deeper" / "r.html", "--out")  # the writer makes the folders
