"""What `megatronapp train` will run: the job and every setting of its ranks, frozen, from the flags.

`build_train_run` is the one translation of `train`'s flags: `cli.main` checks its result before
launching (cli/validate.py), and each rank builds and checks it again from the same flags and
runs it (cli/train.py:run_rank). Below the CLI nothing reads the flags.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from megatronapp.cli.args import build_fbd_config, build_job_config
from megatronapp.cli.injection import InjectionConfig, build_injection_config
from megatronapp.config import JobConfig
from megatronapp.data.config import DataConfig
from megatronapp.dpp.config import DPP_FLAGS, DppConfig
from megatronapp.dpp.rebalance import REBALANCE_FLAGS, RebalanceConfig
from megatronapp.fbd.config import FbdConfig
from megatronapp.flags import read_flags
from megatronapp.scan.analyze.detect_config import DETECT_FLAGS, DetectConfig
from megatronapp.scan.record.trace_config import TRACE_FLAGS, TRACE_SWITCH, TraceConfig
from megatronapp.scope_ui.cli import TrainingScopeConfig, build_training_scope_config


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
    trace: TraceConfig = field(default_factory=TraceConfig)  # enabled by --trace
    detect: DetectConfig = field(default_factory=DetectConfig)  # how the end-of-run report judges the trace
    scope: TrainingScopeConfig | None = None  # --scope
    data_paths: tuple[str, ...] = ()  # empty: the embedded synthetic corpus
    valid_data_paths: tuple[str, ...] = ()  # empty: synthetic documents training never reads (cli/train_eval.py)
    test_data_paths: tuple[str, ...] = ()
    tokenizer_model: str | None = None  # None: bytes
    data: DataConfig = field(default_factory=DataConfig)  # every data flag (indexed datasets, splits, tokenizer type)
    saved_model: dict | None = None  # the model fields of the --load checkpoint, when there is one
    checkpoint_folder: str | None = None  # its iter_ folder, whose files are verified before launch
    nproc_per_node: int | None = None  # launch this many local ranks; None: run in this process
    print_config: bool = False  # print the resolved configuration instead of training
    result_file: str | None = None  # a relaunched rank 0 writes its metrics history here (launch.local)


def build_train_run(args: argparse.Namespace, world_size: int, vocab_size: int | None = None) -> TrainRun:
    """The run `train`'s flags describe on `world_size` ranks (one-line errors for flags that do
    not parse; the rules between settings are cli/validate.py's)."""
    import torch

    from megatronapp.engine.checkpoint import find_latest, has_checkpoint, read_saved_model_fields
    from megatronapp.parallel.device import ranks_per_node

    return TrainRun(
        job=build_job_config(args, world_size, vocab_size),
        world_size=world_size,
        dpp=DppConfig(**read_flags(args, DPP_FLAGS), rebalance=RebalanceConfig(**read_flags(args, REBALANCE_FLAGS))),
        fbd=build_fbd_config(args),
        injection=build_injection_config(args),
        device=args.device,
        visible_gpus=torch.cuda.device_count(),
        ranks_per_node=ranks_per_node(),
        trace=TraceConfig(**read_flags(args, (TRACE_SWITCH, *TRACE_FLAGS))),
        detect=DetectConfig(**read_flags(args, DETECT_FLAGS)),
        scope=build_training_scope_config(args),
        data_paths=tuple(args.data_path or ()),
        valid_data_paths=tuple(args.valid_data_path or ()),
        test_data_paths=tuple(args.test_data_path or ()),
        tokenizer_model=args.tokenizer_model,
        data=build_data_config(args),
        saved_model=read_saved_model_fields(args.load) if args.load else None,
        checkpoint_folder=str(find_latest(args.load)) if args.load and has_checkpoint(args.load) else None,
        nproc_per_node=args.nproc_per_node,
        print_config=args.print_config,
        result_file=args.result_file,
    )


def build_data_config(args: argparse.Namespace) -> DataConfig:
    """The data flags `train` was given."""
    return DataConfig(
        data_path=tuple(args.data_path or ()),
        split=args.split,
        train_data_path=tuple(args.train_data_path or ()),
        valid_data_path=tuple(args.valid_data_path or ()),
        test_data_path=tuple(args.test_data_path or ()),
        tokenizer_type=args.tokenizer_type,
        tokenizer_model=args.tokenizer_model,
        vocab_size=args.vocab_size,
    )
