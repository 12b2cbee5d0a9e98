"""MegaFBD's checks of a job before launch: its role layout, action lists and placements (the flags
are fbd/config.py's).

World size = backward ranks (TP x PP x DP) + forward ranks (TF x PP x DP); the engine's
job config describes the backward layout, so its world is the backward ranks only.
"""

from __future__ import annotations

from megatronapp.config import ConfigError, JobConfig
from megatronapp.fbd.config import FbdConfig, validate_fbd_job
from megatronapp.fbd.layout import RoleLayout, compute_role_placements, role_group_ranks
from megatronapp.fbd.plan import build_fbd_plan
from megatronapp.fbd.validate import validate_fbd_plan
from megatronapp.parallel.layout import LayoutError
from megatronapp.parallel.placement import Placement, check_gpu_groups, resolve_device_kind


def build_role_layout(world: int, tp_size: int, pp_size: int, cfg: FbdConfig) -> RoleLayout:
    """The FBD role layout of `world` ranks; one-line ConfigError when it does not fit."""
    try:
        return RoleLayout(world, tp_size, pp_size, cfg.forward_tp_size)
    except LayoutError as e:
        raise ConfigError(str(e)) from None


def check_fbd_job(cfg: FbdConfig, job: JobConfig, world: int) -> None:
    """FBD's constraints, and its action lists for two iterations checked (validate.py)."""
    validate_fbd_job(job, cfg, world)
    lay = build_role_layout(world, job.layout.tp_size, job.layout.pp_size, cfg)
    plan = build_fbd_plan(lay, job.num_microbatches, cfg.max_ahead, range(2), job.logging.log_interval)
    validate_fbd_plan(plan)


def compute_fbd_placements(
    device: str | None,
    forward_device: str | None,
    lay: RoleLayout,
    visible_gpus: int,
    ranks_per_node: int | None = None,
) -> tuple[Placement, ...]:
    """Where every rank of the FBD job computes (--device, --forward-device); one-line ConfigError
    for a device that is not there or a layout NCCL cannot run (two ranks of a group on one GPU)."""
    try:
        backward = resolve_device_kind(device, visible_gpus)
        forward = resolve_device_kind(forward_device or backward, visible_gpus, "--forward-device")
        placements = compute_role_placements(lay, backward, forward, visible_gpus, ranks_per_node)
        check_gpu_groups(role_group_ranks(lay), placements, visible_gpus)
    except LayoutError as e:
        raise ConfigError(str(e)) from None
    return placements
