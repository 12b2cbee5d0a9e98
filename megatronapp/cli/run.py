"""What `megatronapp train` will run: the job and every setting of its ranks, frozen, from the flags.

`build_train_run` is the one translation of `train`'s flags: `cli.main` checks its result before
launching (cli/validate.py), and each rank builds it again from the same flags and runs it
(cli/train.py). Below the CLI nothing reads the flags.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from megatronapp.cli.args import build_job_config
from megatronapp.cli.injection import InjectionConfig, build_injection_config
from megatronapp.config import JobConfig
from megatronapp.data.config import DataConfig, build_data_config
from megatronapp.dpp.config import DppConfig, build_dpp_config
from megatronapp.fbd.cli import fbd_config_from_args
from megatronapp.fbd.config import FbdConfig
from megatronapp.scan.record.tracer import TraceConfig
from megatronapp.scope_ui.training import TrainingScopeConfig, build_training_scope_config


@dataclass(frozen=True)
class TrainRun:
    """A training job, its modules' settings and what its checks read from the host."""

    job: JobConfig
    world_size: int  # every rank; under FBD backward + forward ranks (job.layout holds the backward ones)
    dpp: DppConfig = field(default_factory=DppConfig)
    fbd: FbdConfig | None = None  # None: no --forward-backward-disaggregating
    injection: InjectionConfig = field(default_factory=InjectionConfig)  # --inject-*: tests and studies
    device: str | None = None  # --device; None: cuda when present
    visible_gpus: int = 0
    ranks_per_node: int | None = None  # torchrun's LOCAL_WORLD_SIZE; None: every rank on this node
    trace: TraceConfig | None = None  # --trace
    scope: TrainingScopeConfig | None = None  # --scope
    data_paths: tuple[str, ...] = ()  # empty: the embedded synthetic corpus
    valid_data_paths: tuple[str, ...] = ()  # empty: held-out synthetic documents (cli/train_eval.py)
    test_data_paths: tuple[str, ...] = ()
    tokenizer_model: str | None = None  # None: bytes
    data: DataConfig = field(default_factory=DataConfig)  # every data flag (indexed datasets, splits, tokenizer type)
    saved_model: dict | None = None  # the model fields of the --load checkpoint, when there is one


def build_train_run(args: argparse.Namespace, world_size: int, vocab_size: int | None = None) -> TrainRun:
    """The run `train`'s flags describe on `world_size` ranks (one-line errors for flags that do
    not parse; the rules between settings are cli/validate.py's)."""
    import torch

    from megatronapp.engine.checkpoint import read_saved_model_fields
    from megatronapp.parallel.device import ranks_per_node
    from megatronapp.scan.record.trace_config import trace_fields_from_args

    return TrainRun(
        job=build_job_config(args, world_size, vocab_size),
        world_size=world_size,
        dpp=build_dpp_config(args),
        fbd=fbd_config_from_args(args) if args.forward_backward_disaggregating else None,
        injection=build_injection_config(args),
        device=args.device,
        visible_gpus=torch.cuda.device_count(),
        ranks_per_node=ranks_per_node(),
        trace=TraceConfig(enabled=True, **trace_fields_from_args(args)) if args.trace else None,
        scope=build_training_scope_config(args),
        data_paths=tuple(args.data_path or ()),
        valid_data_paths=tuple(args.valid_data_path or ()),
        test_data_paths=tuple(args.test_data_path or ()),
        tokenizer_model=args.tokenizer_model,
        data=build_data_config(args),
        saved_model=read_saved_model_fields(args.load) if args.load else None,
    )
