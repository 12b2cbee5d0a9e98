"""One truth per run: every command turns its flags into one frozen run, checked once, and what
runs it reads only that run, never the parsed flags.

Checked four ways: every command (each leaf of the parser) builds a run; its `launch` takes
(run, argv) and nothing else; the run built from a representative command line holds no
argparse namespace anywhere inside it;
and no module below the command line (outside cli/, megatronapp/flags.py and the components'
flag adapters listed below) imports argparse or names its Namespace.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
from pathlib import Path

import pytest
from test_cli_help import walk_parsers

from megatronapp.cli.main import build_checked_run, build_parser

PACKAGE = Path(__file__).resolve().parents[2] / "megatronapp"

# The components' flag adapters: each declares its command's flags and turns the parsed flags
# into its frozen run (`build_*_run`) or, for a command that launches nothing, handles them.
ADAPTERS = {
    "flags.py",
    "dpp/cli.py",
    "inference/cli.py",
    "interop/cli.py",
    "scan/cli.py",
    "scan/trace_run.py",
    "scan/probe_run.py",
    "scope/cli.py",
    "scope_ui/cli.py",
    "faultlab/evaluation/cli.py",
}


def _representative_argv(checkpoint: str, script: str) -> dict[tuple[str, ...], list[str]]:
    return {
        ("train",): ["train", "--model", "tiny", "--device", "cpu", "--trace", "--inject-slowdown", "0:2"],
        ("generate",): ["generate", "--load", checkpoint, "--prompt", "a", "--max-new-tokens", "4"],
        ("scope", "capture"): [
            *("scope", "capture", "--load", checkpoint, "--prompt", "a", "--max-new-tokens", "4"),
            *("--out", "c.safetensors"),
        ],
        ("scope", "serve"): ["scope", "serve", "--load", checkpoint, "--device", "cpu"],
        ("trace", "run"): ["trace", "run", "--inject-slowdown", "0:2", "--", script],
        ("trace", "probe"): ["trace", "probe", "--nproc-per-node", "2", "--pipeline-model-parallel-size", "2"],
        ("schedule", "simulate"): ["schedule", "simulate", "--inject-jitter", "1:1.5"],
        ("schedule", "show"): ["schedule", "show", "--out", "s.png"],
        ("trace", "merge"): ["trace", "merge", "traces", "-o", "t.json", "--ranks", "0-1", "--iterations", "2:4"],
        ("trace", "detect"): ["trace", "detect", "traces", "--iterations", "2:", "--json"],
        ("trace", "whatif"): ["trace", "whatif", "traces"],
        ("trace", "report"): ["trace", "report", "traces", "--out", "r.html"],
        ("trace", "check"): ["trace", "check", "t.json"],
        ("export", "hf"): ["export", "hf", "--load", checkpoint, "--out", "hf"],
        ("import", "hf"): ["import", "hf", "--from", "hf", "--save", "ckpt"],
        ("scope", "report"): ["scope", "report", "c.safetensors", "--out", "pictures"],
        ("preprocess-data",): ["preprocess-data", "--input", script, "--output-prefix", "out"],
    }


def _launching_commands() -> dict[tuple[str, ...], argparse.ArgumentParser]:
    return {path: p for path, p in walk_parsers(build_parser()) if "build_run" in p._defaults}


def test_every_command_builds_a_run_and_has_a_representative_command_line():
    leaves = {path for path, p in walk_parsers(build_parser()) if path and not _subcommands(p)}
    assert set(_launching_commands()) == leaves
    assert set(_representative_argv("ckpt", "s.py")) == leaves


def _subcommands(parser: argparse.ArgumentParser) -> list:
    return [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]


@pytest.mark.parametrize("path", sorted(_representative_argv("ckpt", "s.py")), ids=" ".join)
def test_launch_takes_the_run_and_the_command_line_only(path):
    launch = _launching_commands()[path]._defaults["launch"]
    assert list(inspect.signature(launch).parameters) == ["run", "argv"], path


def _namespaces_inside(value, where: str = "run"):
    """Paths to every argparse.Namespace inside `value` (dataclasses, tuples, lists, dicts)."""
    if isinstance(value, argparse.Namespace):
        yield where
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            yield from _namespaces_inside(getattr(value, f.name), f"{where}.{f.name}")
    elif isinstance(value, (tuple, list)):
        for i, item in enumerate(value):
            yield from _namespaces_inside(item, f"{where}[{i}]")
    elif isinstance(value, dict):
        for k, item in value.items():
            yield from _namespaces_inside(item, f"{where}[{k!r}]")


@pytest.fixture(scope="module")
def runs(tiny_checkpoint, tmp_path_factory):
    script = tmp_path_factory.mktemp("script") / "train.py"
    script.write_text("pass\n")
    runs = {}
    for path, argv in _representative_argv(tiny_checkpoint, str(script)).items():
        if path in READS_FILES:  # their checks want real traces, timelines, captures, HF folders
            args = build_parser().parse_args(argv)
            runs[path] = args.build_run(args)
        else:
            runs[path] = build_checked_run(argv)
    return runs


READS_FILES = {
    *(("trace", c) for c in ("merge", "detect", "whatif", "report", "check")),
    ("export", "hf"),
    ("import", "hf"),
    ("scope", "report"),
}


def test_runs_hold_no_namespace_and_are_frozen(runs):
    for path, run in runs.items():
        assert not list(_namespaces_inside(run)), path
        assert type(run).__dataclass_params__.frozen, path


def test_the_namespace_walk_finds_a_nested_one():
    @dataclasses.dataclass(frozen=True)
    class Holder:
        inner: tuple

    assert list(_namespaces_inside(Holder((1, {"a": argparse.Namespace()})))) == ["run.inner[1]['a']"]


def _reads_namespace(source: str) -> list[int]:
    """Lines importing argparse or naming argparse.Namespace."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Import)
            and any(a.name == "argparse" for a in node.names)
            or isinstance(node, ast.ImportFrom)
            and node.module == "argparse"
            or isinstance(node, ast.Attribute)
            and node.attr == "Namespace"
        ):
            lines.append(node.lineno)
    return lines


def test_no_module_below_the_command_line_reads_parsed_flags():
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel.startswith("cli/") or rel in ADAPTERS:
            continue
        if lines := _reads_namespace(path.read_text()):
            found[rel] = lines
    assert not found, f"argparse below the command line (take the frozen run instead): {found}"


def test_the_static_check_sees_a_namespace():
    assert _reads_namespace("import argparse\n") == [1]
    assert _reads_namespace("def f(a: 'x'):\n    return argparse.Namespace\n") == [2]
    assert _reads_namespace("from megatronapp.config import JobConfig\n") == []
