"""Where the ranks of a `train` job compute, checked before anything is launched.

The placement rule and the transport choice are pure (parallel/placement.py); the CLI reads
the flags, the visible GPUs and torchrun's ranks per node into a TrainRun (cli/validate.py).
"""

from __future__ import annotations

from megatronapp.config import ConfigError, JobConfig
from megatronapp.fbd.config import FbdConfig
from megatronapp.parallel.device import check_layout_devices
from megatronapp.parallel.layout import LayoutError


def check_job_devices(
    job: JobConfig, world: int, device: str | None, fbd: FbdConfig | None, visible_gpus: int, ranks_per_node: int | None
) -> None:
    """One-line ConfigError when a requested device is missing, or when the layout would put two
    ranks of one NCCL group on one GPU (e.g. PP2 on a one-GPU machine): NCCL refuses that at
    run time with 'invalid usage', after every process has started."""
    if fbd is not None:
        if job.optimizer.overlap_param_update:
            raise ConfigError("--overlap-param-update is not supported with --forward-backward-disaggregating")
        from megatronapp.fbd.cli import build_role_layout, compute_fbd_placements

        lay = build_role_layout(world, job.layout.tp_size, job.layout.pp_size, fbd)
        compute_fbd_placements(device, fbd.forward_device, lay, visible_gpus, ranks_per_node)
        return
    try:
        kind = check_layout_devices(device, job.layout, visible_gpus)
    except LayoutError as e:
        raise ConfigError(str(e)) from None
    if job.train.pipeline_recv_ahead and kind == "cuda":
        raise ConfigError(
            "--pipeline-recv-ahead needs the CPU (gloo): on NCCL a receive posted ahead can hold up a send"
        )
    if job.optimizer.overlap_param_update and kind != "cuda":
        raise ConfigError("--overlap-param-update needs CUDA (the update runs on a side stream)")
