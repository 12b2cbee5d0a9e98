"""Every command-line default is its config dataclass field's default: a flag either takes the
field's value as its default, or defaults to None and the built config then holds the field's
value. Checked for every command (a flag added to a second command is covered too)."""

from __future__ import annotations

import dataclasses

import pytest
from test_cli_help import walk_parsers

from megatronapp.cli.args import build_job_config
from megatronapp.cli.main import build_parser
from megatronapp.dpp.config import DppConfig
from megatronapp.fbd.config import FbdConfig
from megatronapp.inference.generate import SamplingConfig
from megatronapp.job import FIELD_COMPONENTS, component_of
from megatronapp.scan.record.trace_config import TRACE_FLAGS, TraceConfig

SAMPLING_FLAGS = {"max_new_tokens", "top_k", "top_p", "seed"}  # --temperature None: set means sampled
GENERATING_COMMANDS = ("generate", "scope capture")


def field_defaults(cls) -> dict:
    return {f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}


def config_field_of(command: str, dest: str):
    """(dataclass, field) a flag's dest stands for in `command`, or None when it belongs to no config."""
    by_trace_dest = {flag.dest: flag.field for flag in TRACE_FLAGS}
    if dest in by_trace_dest:
        return TraceConfig, by_trace_dest[dest]
    if dest.startswith("dpp_") and dest[4:] in field_defaults(DppConfig):
        return DppConfig, dest[4:]
    if dest.startswith("fbd_") and dest[4:] in field_defaults(FbdConfig):
        return FbdConfig, dest[4:]
    if command in GENERATING_COMMANDS and dest in SAMPLING_FLAGS:
        return SamplingConfig, dest
    if command == "train" and any(dest in field_defaults(cls) for cls in FIELD_COMPONENTS.values()):
        return FIELD_COMPONENTS[component_of(dest)], dest
    return None


def flags_with_config_fields():
    for path, parser in walk_parsers(build_parser()):
        for action in parser._actions:
            found = config_field_of(" ".join(path), action.dest)
            if found and action.option_strings:
                yield " ".join(path), action, *found


FLAGS = list(flags_with_config_fields())


def test_the_table_covers_every_config():
    covered = {(cmd, cls.__name__, name) for cmd, _, cls, name in FLAGS}
    assert {
        ("train", "TraceConfig", "interval"),
        ("trace run", "TraceConfig", "interval"),
        ("train", "DppConfig", "traversal"),
        ("schedule simulate", "DppConfig", "traversal"),
        ("generate", "SamplingConfig", "max_new_tokens"),
        ("scope capture", "SamplingConfig", "max_new_tokens"),
        ("train", "FbdConfig", "max_ahead"),
        ("train", "TrainConfig", "micro_batch_size"),
        ("train", "OptimizerConfig", "lr"),
        ("train", "PrecisionConfig", "fp8_recipe"),
        ("train", "CheckpointConfig", "save_interval"),
        ("train", "LoggingConfig", "log_interval"),
        ("train", "IntegrityConfig", "check_window"),
    } <= covered


@pytest.mark.parametrize(
    "command, action, cls, name", FLAGS, ids=[f"{c}:{a.option_strings[-1]}" for c, a, _, _ in FLAGS]
)
def test_flag_default_is_the_config_default(command, action, cls, name):
    expected = field_defaults(cls)[name]
    if action.default is None and expected is not None:  # the config supplies it: see the built one
        assert cls in FIELD_COMPONENTS.values(), (
            f"{command} {action.option_strings[-1]}: None, but {cls.__name__}.{name} = {expected!r}"
        )
        return
    assert action.default == expected, (
        f"{command} {action.option_strings[-1]} defaults to {action.default!r}, {cls.__name__}.{name} to {expected!r}"
    )


def test_train_without_flags_builds_the_dataclass_defaults():
    """The None-default train flags: the job built from no flags holds its component configs'
    defaults (schedule aside: it follows from the layout, 1f1b without virtual stages)."""
    args = build_parser().parse_args(["train", "--model", "tiny"])
    job = build_job_config(args, 1)
    for component, cls in FIELD_COMPONENTS.items():
        for name, default in field_defaults(cls).items():
            if name != "schedule":
                assert getattr(getattr(job, component), name) == default, (component, name)
    assert job.train.schedule == "1f1b"


def test_ui_generate_message_defaults_are_the_sampling_defaults():
    """The UI's `generate` message samples as `megatronapp generate` does when a field is omitted."""
    from megatronapp.scope_ui.protocol import Generate

    for name, default in field_defaults(SamplingConfig).items():
        assert Generate.model_fields[name].default == default, name
