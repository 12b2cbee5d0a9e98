"""The command-line surface is frozen: `megatronapp --help` and every subcommand's help are
compared with tests/fixtures/cli_help/*.txt, so a changed flag, default or help text is a
deliberate change reviewed in the diff of those files.

Regenerate after a deliberate change:  UPDATE_CLI_HELP=1 python -m pytest tests/cli/test_cli_help.py
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import pytest

from megatronapp.cli.main import build_parser

HELP_DIR = Path(__file__).resolve().parents[1] / "fixtures" / "cli_help"
COLUMNS = "100"  # argparse wraps to the terminal width; fixed so every machine renders the same text
REGENERATE = "UPDATE_CLI_HELP=1 python -m pytest tests/cli/test_cli_help.py"
PYTHON = f"{sys.version_info.major}.{sys.version_info.minor}"  # argparse's layout changes between minors
PYTHON_FILE = HELP_DIR / "python_version"


def walk_parsers(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """(command path, parser) for the parser and every subcommand under it, depth first."""
    yield path, parser
    for action in parser._actions:  # argparse keeps subcommands only in this private list
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from walk_parsers(sub, path + (name,))


def render_helps() -> dict[str, str]:
    """Snapshot file name -> help text of that command."""
    return {
        "_".join(("megatronapp",) + path) + ".txt": parser.format_help()
        for path, parser in walk_parsers(build_parser())
    }


@pytest.fixture(scope="module")
def helps():
    rendered_by = PYTHON_FILE.read_text().strip() if PYTHON_FILE.exists() else None
    if os.environ.get("UPDATE_CLI_HELP") != "1" and rendered_by != PYTHON:
        pytest.skip(
            f"help snapshots were rendered by Python {rendered_by}, this is {PYTHON}; "
            f"regenerate with {REGENERATE} to compare here"
        )
    saved = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = COLUMNS
    try:
        return render_helps()
    finally:
        if saved is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = saved


def test_every_command_has_a_snapshot_and_no_snapshot_is_stale(helps):
    if os.environ.get("UPDATE_CLI_HELP") == "1":
        HELP_DIR.mkdir(parents=True, exist_ok=True)
        for stale in {p.name for p in HELP_DIR.glob("*.txt")} - set(helps):
            (HELP_DIR / stale).unlink()
        for name, text in helps.items():
            (HELP_DIR / name).write_text(text)
        PYTHON_FILE.write_text(PYTHON + "\n")
    on_disk = sorted(p.name for p in HELP_DIR.glob("*.txt"))
    assert on_disk == sorted(helps), f"commands changed; to accept: {REGENERATE}"


def test_help_matches_snapshot(helps):
    changed = [
        name for name, text in helps.items() if not (HELP_DIR / name).exists() or (HELP_DIR / name).read_text() != text
    ]
    assert not changed, f"help text changed for {', '.join(changed)}; if deliberate: {REGENERATE}"


def test_walk_finds_nested_subcommands():
    """The snapshot covers leaves two levels down (a missed level would freeze nothing there)."""
    names = {" ".join(path) for path, _ in walk_parsers(build_parser())}
    assert {"", "train", "trace merge", "schedule simulate", "schedule show", "generate"} <= names
