"""Every flag is defined once, beside the config it sets, and test knobs stay out of the user's way.

The parser is built while `add_argument` is watched: each option string is traced to its
definition (a `Flag` declared beside its config, megatronapp/flags.py, or the source line of a
plain `add_argument`). An option string with two definitions is a flag defined twice, unless it
is listed below with the reason its commands mean different things by it.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

import pytest
from test_cli_help import walk_parsers

import megatronapp.flags
from megatronapp.cli.main import build_parser

PACKAGE = Path(__file__).resolve().parents[2] / "megatronapp"

# The same option string, defined separately because the commands that take it mean different
# things by it (a flag with one meaning shares one definition instead).
SAME_NAME_OTHER_MEANING = {
    "--json": "each command prints its own report as JSON",
    "--out": "each command writes its own kind of file",
    "-o": "each command writes its own kind of file",
    "--iterations": "merge: iterations to merge; detect: iterations to analyse",
    "--load": "train resumes a checkpoint (optional, may be empty); inference commands read a model (required)",
    "--bf16": "train: mixed precision with fp32 master weights; inference: bf16 weights",
    "--seed": "train: the job's seed (TrainConfig); generate: the sampling seed (SamplingConfig)",
    "--prompt": "generate and scope capture take prompts; the two parsers are separate commands",
    "--prompt-file": "generate and scope capture take prompts; the two parsers are separate commands",
    "--max-new-tokens": "generate samples (SamplingConfig); scope capture decodes greedily",
    "--pipeline-model-parallel-size": "schedule simulate|show: the simulated pipeline (default 4), not a job layout",
    "--pipeline-schedule": "schedule simulate|show: also `dynamic` by default, simulated rather than run",
    "--no-split-backward": "schedule simulate|show: the simulator's W filling, not a training setting",
    "--tokenizer-model": "export hf: default the tokenizer saved beside the checkpoint, not bytes",
    "--save": "train saves its checkpoints there (CheckpointConfig); import hf writes the one it converts",
    "--num-layers": "schedule simulate|show has no model: the layer count only turns layers per chunk into chunks",
    "--num-virtual-stages-per-pipeline-rank": "schedule simulate|show: the simulated pipeline's chunks (default 2)",
    "--num-layers-per-virtual-pipeline-stage": "schedule simulate|show: needs --num-layers, the simulator has no model",
}
ARGPARSE_OWN = {"-h", "--help"}


def _definition(frame) -> tuple:
    """Where an add_argument call comes from (`frame` called it): the Flag passed to add_flags,
    or a source line."""
    while frame is not None:
        code = frame.f_code
        if code.co_filename == megatronapp.flags.__file__ and code.co_name == "add_flags":
            return ("flag", id(frame.f_locals["flag"]))
        if not code.co_filename.endswith("argparse.py"):
            return ("line", code.co_filename, frame.f_lineno)
        frame = frame.f_back
    raise AssertionError("add_argument called from argparse itself")


@pytest.fixture(scope="module")
def definitions():
    """option string -> {definition: [command path, ...]} while the whole parser is built."""
    found: dict[str, dict[tuple, list]] = {}
    original = argparse._ActionsContainer.add_argument

    def watched(self, *args, **kwargs):
        where = _definition(sys._getframe(1))
        if kwargs.get("action") is argparse.BooleanOptionalAction:  # it adds --no-X itself
            args = (*args, *(f"--no-{o[2:]}" for o in args if o.startswith("--")))
        for option in args:
            if isinstance(option, str) and option.startswith("-"):
                found.setdefault(option, {}).setdefault(where, []).append(getattr(self, "prog", "group"))
        return original(self, *args, **kwargs)

    argparse._ActionsContainer.add_argument = watched
    try:
        build_parser()
    finally:
        argparse._ActionsContainer.add_argument = original
    return found


def test_no_flag_is_defined_twice(definitions):
    allowed = SAME_NAME_OTHER_MEANING.keys() | ARGPARSE_OWN
    twice = {o: list(d) for o, d in definitions.items() if len(d) > 1 and o not in allowed}
    assert not twice, f"defined in more than one place (share one Flag): {twice}"


def test_every_listed_exception_still_exists(definitions):
    """The list of same-name flags only shrinks: an entry no longer defined twice leaves it."""
    stale = [o for o in SAME_NAME_OTHER_MEANING if len(definitions.get(o, {})) < 2]
    assert not stale, f"remove from SAME_NAME_OTHER_MEANING: {stale}"


def test_the_watch_sees_a_second_definition():
    """A flag defined twice in two modules is caught (the check above can fail)."""
    parser = argparse.ArgumentParser()
    original, seen = argparse._ActionsContainer.add_argument, {}

    def watched(self, *args, **kwargs):
        seen.setdefault(args[0], set()).add(_definition(sys._getframe(1)))
        return original(self, *args, **kwargs)

    argparse._ActionsContainer.add_argument = watched
    try:
        sub = parser.add_subparsers()
        megatronapp.flags.add_flags(sub.add_parser("a"), (megatronapp.flags.Flag("--x"),))
        megatronapp.flags.add_flags(sub.add_parser("b"), (megatronapp.flags.Flag("--x"),))
        sub.add_parser("c").add_argument("--y")
        sub.add_parser("d").add_argument("--y")
    finally:
        argparse._ActionsContainer.add_argument = original
    assert len(seen["--x"]) == 2 and len(seen["--y"]) == 2


# Literal defaults of flags no config dataclass owns (everything else reads its default from one)
LITERAL_DEFAULTS = {
    ("cli/args.py", "--model"): "a preset's name; the preset is the config",
    ("cli/args.py", "--nnodes"): "how many nodes this command launches on, not a setting of the run",
    ("scope_ui/cli.py", "host"): "the servers' shared bind address flag (prefixed for train --scope)",
}


def _literal_defaults(root: Path):
    """(module, option or keyword, value) of every add_argument(default=<literal>) under `root`,
    booleans and None aside; faultlab/evaluation is a tool of its own, outside `megatronapp`."""
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith("faultlab/evaluation/"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument"):
                continue
            for kw in node.keywords:
                value = kw.value
                literal = isinstance(value, ast.Constant) and type(value.value) in (int, float, str)
                if kw.arg == "default" and literal:
                    option = next((a.value for a in node.args if isinstance(a, ast.Constant)), None)
                    name = option or ast.unparse(node.args[0]).split("}")[-1].strip("\"'")
                    yield rel, name, value.value


def test_no_literal_default_duplicates_a_config_default():
    assert (PACKAGE / "cli" / "args.py").is_file()
    assert ("cli/args.py", "--model", "demo") in set(_literal_defaults(PACKAGE))  # the scan sees literals
    found = [(rel, name, v) for rel, name, v in _literal_defaults(PACKAGE) if (rel, name) not in LITERAL_DEFAULTS]
    assert not found, f"defaults written as literals (read them from the config dataclass): {found}"


def test_train_help_shows_no_test_knob():
    train = dict(walk_parsers(build_parser()))[("train",)]
    text = train.format_help()
    assert "--inject" not in text and "--result-file" not in text
    assert {"--inject-slowdown", "--inject-link-delay", "--inject-jitter", "--inject-crash"} <= set(
        train._option_string_actions
    )


def test_every_help_hides_the_test_knobs():
    for path, parser in walk_parsers(build_parser()):
        assert "--inject" not in parser.format_help(), path


def test_clock_skew_reaches_the_run_as_an_injection(train_before_launch):
    """--inject-clock-skew sets one rank's trace clock offset through the run (no environment)."""
    from megatronapp.cli.main import build_checked_run

    run = build_checked_run(["train", "--model", "tiny", "--device", "cpu", "--inject-clock-skew", "0:37000"])
    assert run.injection.clock_skew_of(0) == 37000 and run.injection.clock_skew_of(1) == 0
    code, lines = train_before_launch(["--inject-clock-skew", "3:5"])
    assert code == 2 and lines == ["megatronapp: error: --inject-clock-skew rank 3 is outside world size 1"]
    code, lines = train_before_launch(["--inject-clock-skew", "x"])
    assert code == 2 and "--inject-clock-skew expects RANK:NS" in lines[0]
