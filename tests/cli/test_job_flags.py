"""The train flags for the job's component configs are declared beside those configs (config/),
and the train parser holds exactly those: each sets a field of its own module's config, defaults
to None (the config's default applies unless the flag is given) and shows that default in --help."""

from __future__ import annotations

import argparse
import dataclasses

from test_cli_help import walk_parsers

from megatronapp.cli.main import build_parser
from megatronapp.config import (
    CHECKPOINT_FLAGS,
    EVAL_FLAGS,
    INTEGRITY_FLAGS,
    LOGGING_FLAGS,
    OPTIMIZER_FLAGS,
    PRECISION_FLAGS,
    TRAIN_FLAGS,
    CheckpointConfig,
    EvalConfig,
    IntegrityConfig,
    LoggingConfig,
    OptimizerConfig,
    PrecisionConfig,
    TrainConfig,
)
from megatronapp.flags import BOOLEAN_OPTIONAL, Flag, add_flags
from megatronapp.job import FIELD_COMPONENTS

HOMES = (
    (TRAIN_FLAGS, TrainConfig),
    (OPTIMIZER_FLAGS, OptimizerConfig),
    (PRECISION_FLAGS, PrecisionConfig),
    (CHECKPOINT_FLAGS, CheckpointConfig),
    (LOGGING_FLAGS, LoggingConfig),
    (EVAL_FLAGS, EvalConfig),
    (INTEGRITY_FLAGS, IntegrityConfig),
)


def _train_parser() -> argparse.ArgumentParser:
    return dict(walk_parsers(build_parser()))[("train",)]


def test_each_flag_sets_a_field_of_the_config_beside_it():
    for flags, cls in HOMES:
        strays = [f.option for f in flags if f.field not in cls.__dataclass_fields__]
        assert not strays, f"{cls.__name__} has no field for {strays}"


def test_the_train_parser_has_no_job_flag_outside_the_configs():
    declared = {f.option for flags, _ in HOMES for f in flags}
    job_fields = {n for cls in FIELD_COMPONENTS.values() for n in cls.__dataclass_fields__}
    in_parser = {a.option_strings[0] for a in _train_parser()._actions if a.dest in job_fields and a.option_strings}
    assert in_parser == declared


def test_job_flags_default_to_none_and_show_the_config_default():
    actions = {a.option_strings[0]: a for a in _train_parser()._actions if a.option_strings}
    assert actions["--lr"].default is None and actions["--lr"].help.endswith(f"(default: {OptimizerConfig.lr})")
    assert actions["--save"].help == "(default: None)"
    assert actions["--overlap-grad-reduce"].help == "overlap the DP reduction with backward (default)"
    assert actions["--deterministic-mode"].help == argparse.SUPPRESS
    assert actions["--deterministic-mode"].dest == "deterministic"


def test_the_boolean_optional_marker_becomes_argparse_action():
    @dataclasses.dataclass
    class Config:
        on: bool = True

    parser = argparse.ArgumentParser()
    add_flags(parser, (Flag("--on", "on", "switch", {"action": BOOLEAN_OPTIONAL}),), Config)
    assert parser.parse_args([]).on is True and parser.parse_args(["--no-on"]).on is False
