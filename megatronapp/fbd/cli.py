"""MegaFBD's command-line flags (Megatron style) and their translation into configs.

World size = backward ranks (TP x PP x DP) + forward ranks (TF x PP x DP); the engine's
job config describes the backward layout, so its world is the backward ranks only.
"""

from __future__ import annotations

import argparse

from megatronapp.config import ConfigError, JobConfig
from megatronapp.fbd.config import FbdConfig, validate_fbd_job
from megatronapp.fbd.layout import RoleLayout, compute_role_placements, role_group_ranks
from megatronapp.fbd.plan import build_fbd_plan
from megatronapp.fbd.validate import validate_fbd_plan
from megatronapp.parallel.layout import LayoutError
from megatronapp.parallel.placement import Placement, check_gpu_groups, resolve_device_kind


def add_fbd_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("forward-backward disaggregation (MegaFBD)")
    g.add_argument(
        "--forward-backward-disaggregating",
        action="store_true",
        help="forward workers (no autograd) stream stage inputs to backward workers, which "
        "recompute, run backward and own the optimizer",
    )
    g.add_argument(
        "--forward-tensor-model-parallel-size",
        type=int,
        default=None,
        metavar="TF",
        help="tensor-parallel size of forward workers (default: TP)",
    )
    g.add_argument(
        "--forward-device",
        choices=("cpu", "cuda"),
        default=None,
        help="where forward workers compute (default: --device)",
    )
    g.add_argument(
        "--fbd-max-ahead",
        type=int,
        default=FbdConfig.max_ahead,
        metavar="N",
        help="microbatches a forward worker may run ahead of its backward twin",
    )
    g.add_argument(
        "--inject-crash",
        default=None,
        metavar="RANK:ITER",
        help="that global rank raises at the start of that iteration (failure-handling tests)",
    )


def fbd_config_from_args(args: argparse.Namespace) -> FbdConfig:
    return FbdConfig(
        forward_tp_size=args.forward_tensor_model_parallel_size or args.tensor_model_parallel_size,
        forward_device=args.forward_device,
        max_ahead=args.fbd_max_ahead,
    )


def build_role_layout(world: int, tp_size: int, pp_size: int, cfg: FbdConfig) -> RoleLayout:
    """The FBD role layout of `world` ranks; one-line ConfigError when it does not fit."""
    try:
        return RoleLayout(world, tp_size, pp_size, cfg.forward_tp_size)
    except LayoutError as e:
        raise ConfigError(str(e)) from None


def role_layout_from_args(args: argparse.Namespace, world: int) -> RoleLayout:
    return build_role_layout(
        world, args.tensor_model_parallel_size, args.pipeline_model_parallel_size, fbd_config_from_args(args)
    )


def layout_world_size(args: argparse.Namespace, world: int) -> int:
    """World of the engine's layout: all ranks, or the backward ranks under FBD (checked)."""
    if not args.forward_backward_disaggregating:
        for flag in ("forward_tensor_model_parallel_size", "forward_device", "inject_crash"):
            if getattr(args, flag) is not None:
                raise ConfigError(f"--{flag.replace('_', '-')} needs --forward-backward-disaggregating")
        return world
    return role_layout_from_args(args, world).num_backward


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
