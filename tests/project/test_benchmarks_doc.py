"""Every command BENCHMARKS.md publishes, and every README command that runs a benchmark or the
`megatronapp` CLI, parses with the argument parser of the program it names: the benchmark
script's own `build_parser()` (loaded from its file, nothing run) or the CLI's. A renamed or
removed flag, script or subcommand fails here instead of in a reader's terminal."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import re
import shlex
import sys
from pathlib import Path

import pytest

from megatronapp.cli.main import build_parser as build_cli_parser

ROOT = Path(__file__).resolve().parents[2]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
SEPARATORS = {"&&", "||", ";", "|"}


def extract_shell_lines(markdown: str) -> list[str]:
    """The shell code blocks' logical lines: continuations joined, comments dropped."""
    lines = []
    for lang, body in FENCE.findall(markdown):
        if lang not in ("", "bash", "sh"):
            continue
        pending = ""
        for raw in body.splitlines():
            text = pending + raw.strip()
            if text.endswith("\\"):
                pending = text[:-1].rstrip() + " "
                continue
            pending = ""
            if text and not text.startswith("#"):
                lines.append(text)
    return lines


def split_commands(line: str) -> list[list[str]]:
    """One shell line as its commands' argv lists (split at && || ; |, comments removed; an
    optional part written as [--flag value] counts as given, a literal ... as nothing)."""
    lexer = shlex.shlex(line.replace("[", " ").replace("]", " "), posix=True, punctuation_chars=";&|")
    lexer.whitespace_split, lexer.commenters = True, "#"
    commands, current = [], []
    for token in lexer:
        if token in SEPARATORS:
            commands.append(current)
            current = []
        elif token != "...":
            current.append(token)
    return [c for c in commands + [current] if c]


def program_and_args(argv: list[str]) -> tuple[str, list[str]] | None:
    """("megatronapp" | a script path, its arguments) for a command that names a parser, else None."""
    while argv and re.fullmatch(r"[A-Z_]+=\S*", argv[0]):  # PYTHONPATH=. and the like
        argv = argv[1:]
    if not argv:
        return None
    if argv[0] == "megatronapp":
        return "megatronapp", argv[1:]
    if "megatronapp.cli.main" in argv:  # python -m / torchrun ... -m megatronapp.cli.main
        return "megatronapp", argv[argv.index("megatronapp.cli.main") + 1 :]
    if argv[0] in ("python", "python3") and len(argv) > 1 and argv[1].endswith(".py"):
        return argv[1], argv[2:]
    return None


def documented_commands() -> list[tuple[str, str, list[str]]]:
    """(where, program, args) for BENCHMARKS.md's commands and the README's that run
    benchmarks/ or megatronapp."""
    found = []
    for doc in ("BENCHMARKS.md", "README.md"):
        for line in extract_shell_lines((ROOT / doc).read_text()):
            assert not line.startswith("-"), f"{doc}: flags without a command (a broken line continuation?): {line}"
            for argv in split_commands(line):
                parsed = program_and_args(argv)
                if parsed is not None:
                    found.append((doc, *parsed))
    return found


def load_parser(script: str):
    """The script's build_parser(), imported from its file with its folder on sys.path (where its
    sibling modules are found when it runs)."""
    path = ROOT / script
    assert path.is_file(), f"no such script: {script}"
    sys.path.insert(0, str(path.parent))
    try:
        spec = importlib.util.spec_from_file_location(f"_documented_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(path.parent))
    assert hasattr(module, "build_parser"), f"{script} has no build_parser()"
    return module.build_parser()


def parse_error(parser, args: list[str]) -> str | None:
    """argparse's complaint about args, or None when they parse."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            parser.parse_args(args)
    except SystemExit as exc:
        return err.getvalue().strip().splitlines()[-1] if exc.code else None
    return None


COMMANDS = documented_commands()


def test_the_documents_publish_commands_of_every_kind():
    programs = {program for _, program, _ in COMMANDS}
    assert "megatronapp" in programs and len([p for p in programs if p.startswith("benchmarks/")]) >= 8


@pytest.mark.parametrize("where,program,args", COMMANDS, ids=[f"{w}:{p}:{' '.join(a)[:60]}" for w, p, a in COMMANDS])
def test_a_documented_command_parses(where, program, args):
    parser = build_cli_parser() if program == "megatronapp" else load_parser(program)
    error = parse_error(parser, args)
    assert error is None, f"{where}: `{program} {' '.join(args)}` does not parse: {error}"


def test_a_renamed_flag_or_script_is_caught(tmp_path):
    """The check itself can fail: an unknown flag, a missing script, flags cut off their command."""
    assert parse_error(build_cli_parser(), ["train", "--no-such-flag"]) is not None
    assert parse_error(load_parser("benchmarks/scan_scale.py"), ["--repeats", "three"]) is not None
    with pytest.raises(AssertionError, match="no such script"):
        load_parser("benchmarks/removed_probe.py")
    assert split_commands("PYTHONPATH=. python benchmarks/a.py --x 1 [--y 2] && megatronapp train ... # c") == [
        ["PYTHONPATH=.", "python", "benchmarks/a.py", "--x", "1", "--y", "2"],
        ["megatronapp", "train"],
    ]
    assert extract_shell_lines("```bash\nmegatronapp train \\\n  --seed 1 \\   # why\n  --bf16\n```\n") == [
        "megatronapp train --seed 1 \\   # why",
        "--bf16",
    ]
