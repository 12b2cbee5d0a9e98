"""What a newcomer meets first: --version, usage on a bare command, help on every flag, and one
name or the other for the virtual pipeline stage count."""

from __future__ import annotations

import argparse
import json
import warnings

import pytest
from test_cli_help import walk_parsers

from megatronapp.cli.main import build_parser, main


def _main(argv: list[str], capsys) -> tuple[int, str, str]:
    with warnings.catch_warnings():  # main's @record wants a real stderr for faulthandler
        warnings.filterwarnings("ignore", "Unable to enable fault handler")
        try:
            code = main(argv)
        except SystemExit as exc:
            code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_version_names_the_package_torch_and_python(capsys):
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["--version"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0
    assert out.startswith("megatronapp ") and "torch " in out and "Python 3." in out


@pytest.mark.parametrize("group", [[], ["trace"], ["scope"], ["export"], ["import"], ["schedule"]])
def test_a_bare_command_group_prints_its_usage(capsys, group):
    code, out, err = _main(group, capsys)
    assert code == 2 and out == ""
    assert err.startswith(f"usage: {' '.join(['megatronapp', *group])} ")
    assert "positional arguments" in err and ": error:" not in err


def test_every_flag_of_every_command_has_help():
    missing = [
        f"{' '.join(('megatronapp', *path))} {'/'.join(action.option_strings) or action.dest}"
        for path, parser in walk_parsers(build_parser())
        for action in parser._actions
        if not isinstance(action, argparse._SubParsersAction) and not action.help
    ]
    assert not missing, f"flags without help: {', '.join(missing)}"


def test_help_shows_the_defaults(capsys):
    parser = dict(walk_parsers(build_parser()))[("generate",)]
    text = " ".join(parser.format_help().split())
    assert "(default: 32)" in text and "(default: 1.0)" in text  # --max-new-tokens, --top-p


def _resolved_layout(argv: list[str], capsys) -> dict:
    code, out, err = _main(["train", "--device", "cpu", "--model", "tiny", "--print-config", *argv], capsys)
    assert code == 0, err
    return json.loads(out)["layout"]


def test_train_takes_either_name_for_the_virtual_stage_count(capsys):
    base = ["--nproc-per-node", "2", "--pipeline-model-parallel-size", "2"]
    by_layers = _resolved_layout([*base, "--num-layers-per-virtual-pipeline-stage", "1"], capsys)
    by_chunks = _resolved_layout([*base, "--num-virtual-stages-per-pipeline-rank", "2"], capsys)
    assert by_layers == by_chunks and by_chunks["virtual_pp_size"] == 2


def _simulated(argv: list[str], capsys) -> dict:
    code, out, err = _main(["schedule", "simulate", "--json", "--pipeline-model-parallel-size", "2", *argv], capsys)
    assert code == 0, err
    return json.loads(out)


def test_schedule_takes_either_name_for_the_virtual_stage_count(capsys):
    by_chunks = _simulated(["--num-virtual-stages-per-pipeline-rank", "3"], capsys)
    by_layers = _simulated(["--num-layers", "12", "--num-layers-per-virtual-pipeline-stage", "2"], capsys)
    assert by_layers == by_chunks


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            [
                "train",
                "--device",
                "cpu",
                "--model",
                "tiny",
                "--num-layers-per-virtual-pipeline-stage",
                "1",
                "--num-virtual-stages-per-pipeline-rank",
                "2",
            ],
            "not allowed with argument",
        ),
        (
            [
                "schedule",
                "simulate",
                "--num-layers-per-virtual-pipeline-stage",
                "1",
                "--num-virtual-stages-per-pipeline-rank",
                "2",
            ],
            "not allowed with argument",
        ),
        (["schedule", "simulate", "--num-layers-per-virtual-pipeline-stage", "1"], "needs --num-layers"),
        (
            ["schedule", "simulate", "--num-layers", "10", "--num-layers-per-virtual-pipeline-stage", "2"],
            "num layers 10 is not divisible by pipeline-parallel size 4 x layers per virtual stage 2",
        ),
    ],
    ids=["train-both", "schedule-both", "schedule-no-layers", "schedule-indivisible"],
)
def test_inconsistent_virtual_stage_flags_are_one_line(capsys, argv, message):
    code, _, err = _main(argv, capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and message in lines[0], err
