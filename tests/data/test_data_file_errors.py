"""A --data-path, --valid-data-path or --test-data-path file that is not a text corpus is one line
naming the flag and the file, exit code 2, before launch."""

from __future__ import annotations

import pytest


def _binary(path):
    path.write_bytes(bytes(range(256)) * 8)


def _latin1(path):
    path.write_bytes("a café in Zürich\n".encode("latin-1"))


def _empty(path):
    path.write_bytes(b"")


def _bad_jsonl(path):
    path.write_text('{"text": "ok"}\n{"text": "cut\n')


@pytest.mark.parametrize(
    "name, write, message",
    [
        ("corpus.txt", _binary, "a binary file, not UTF-8 text (NUL byte at offset 0)"),
        ("corpus.jsonl", _binary, "a binary file, not UTF-8 text (NUL byte at offset 0)"),
        ("corpus.txt", _latin1, "not valid UTF-8 at byte 5"),
        ("corpus.txt", _empty, "empty file"),
        ("corpus.jsonl", _empty, "empty file"),
        ("corpus.jsonl", _bad_jsonl, ":2: invalid JSON"),
    ],
    ids=["binary-txt", "binary-jsonl", "latin1-txt", "empty-txt", "empty-jsonl", "truncated-jsonl"],
)
def test_a_broken_data_file_is_one_line_before_launch(tmp_path, train_before_launch, name, write, message):
    path = tmp_path / name
    write(path)
    before = path.read_bytes()
    code, err = train_before_launch(["--nproc-per-node", "2", "--train-iters", "1", "--data-path", str(path)])
    assert code == 2
    assert len(err) == 1 and err[0].startswith(f"megatronapp: error: --data-path {path}"), err
    assert message in err[0]
    assert path.read_bytes() == before and sorted(tmp_path.iterdir()) == [path]


def test_a_folder_of_blank_documents_is_refused_before_launch(tmp_path, train_before_launch):
    (tmp_path / "blank.txt").write_text("\n\n  \n")
    code, err = train_before_launch(["--train-iters", "1", "--data-path", str(tmp_path)])
    assert code == 2
    assert err == [f"megatronapp: error: --data-path {tmp_path}: no non-empty documents"]


GOOD = "the cat sat on the mat.\n" * 50


@pytest.mark.parametrize("flag", ["--valid-data-path", "--test-data-path"])
@pytest.mark.parametrize(
    "write, message",
    [(_binary, "a binary file"), (_latin1, "not valid UTF-8 at byte 5"), (_empty, "empty file")],
    ids=["binary", "latin1", "empty"],
)
def test_a_broken_evaluation_file_is_one_line_before_launch(tmp_path, train_before_launch, flag, write, message):
    train, path = tmp_path / "train.txt", tmp_path / "held_out.txt"
    train.write_text(GOOD)
    write(path)
    before = path.read_bytes()
    args = ["--nproc-per-node", "2", "--train-iters", "2", "--eval-interval", "1", "--eval-iters", "1"]
    valid = [] if flag == "--valid-data-path" else ["--valid-data-path", str(train)]
    code, err = train_before_launch([*args, "--data-path", str(train), *valid, flag, str(path)])
    assert code == 2
    assert len(err) == 1 and err[0].startswith(f"megatronapp: error: {flag} {path}"), err
    assert message in err[0]
    assert path.read_bytes() == before and sorted(tmp_path.iterdir()) == [path, train]
