"""How the CLI plugs MegaDPP into a training job: checks before launch, hooks per rank."""

from __future__ import annotations

import functools

from megatronapp.dpp.config import DppConfig, DppConfigError, JitterSpec
from megatronapp.dpp.jitter import apply_jitter
from megatronapp.dpp.policies import compute_depth_first_order
from megatronapp.dpp.rebalance import RebalanceConfig
from megatronapp.dpp.scheduler import check_cap, check_order_fits
from megatronapp.engine.replica_split import compute_microbatch_granule


def check_dpp_job(cfg: DppConfig, job) -> DppConfig:
    """The MegaDPP settings checked against the job (one-line errors): a --dpp-max-inflight cap
    that every pipeline rank's order fits."""
    if job.train.schedule == "dynamic":
        if cfg.max_inflight is not None:
            check_cap(cfg.max_inflight, job.layout.virtual_pp_size)
        if cfg.max_inflight is not None and cfg.traversal == "in-order":
            pp, v, counts = job.layout.pp_size, job.layout.virtual_pp_size, {job.num_microbatches}
            if cfg.rebalance.mode in ("microbatches", "all"):  # a replica may run all but one each of the others
                counts.add(job.layout.dp_size * job.num_microbatches - job.layout.dp_size + 1)
            for p in range(pp):
                for count in sorted(counts):
                    check_order_fits(compute_depth_first_order(p, pp, v, count), cfg.max_inflight, v, p)
    return cfg


def check_rebalance_job(cfg: RebalanceConfig, job, *, fbd: bool, scope: bool) -> None:
    """--dpp-rebalance against the job (one-line errors)."""
    if cfg.mode == "off":
        return
    if cfg.mode in ("layers", "all") and job.layout.pp_size < 2:
        raise DppConfigError(f"--dpp-rebalance {cfg.mode} needs pipeline-parallel size >= 2")
    if cfg.mode in ("microbatches", "all"):
        _check_microbatch_rebalance(cfg.mode, job)
    if fbd:
        raise DppConfigError("--dpp-rebalance cannot be combined with --forward-backward-disaggregating")
    if scope:
        raise DppConfigError(
            "--dpp-rebalance cannot be combined with --scope (its hooks sit on layers and microbatches that move)"
        )


def _check_microbatch_rebalance(mode: str, job) -> None:
    """A split needs two replicas and a microbatch to move: one granule each and one more."""
    lay = job.layout
    if lay.dp_size < 2:
        raise DppConfigError(f"--dpp-rebalance {mode} needs data-parallel size >= 2")
    granule = compute_microbatch_granule(job.train.schedule, lay.pp_size)
    if job.num_microbatches < 2 * granule:
        why = "" if granule == 1 else f" (the {job.train.schedule} schedule moves them in groups of {granule})"
        raise DppConfigError(
            f"--dpp-rebalance {mode} needs at least {2 * granule} microbatches per data-parallel replica to move "
            f"any{why}, got {job.num_microbatches}: raise --global-batch-size"
        )


def build_dynamic_runtime_factory(cfg: DppConfig, job):
    """A Trainer runtime_factory(model, groups, *, device, tracer, reducer, injector) for dynamic."""
    from megatronapp.dpp.runtime import DynamicPipelineRuntime

    return functools.partial(
        DynamicPipelineRuntime, config=cfg, num_chunks=job.layout.virtual_pp_size, num_microbatches=job.num_microbatches
    )


def build_dpp_hooks(cfg: DppConfig, jitter: tuple[JitterSpec, ...], job, rank: int, device, injector):
    """(injector with this rank's --inject-jitter, runtime_factory or None) for Trainer(...)."""
    factory = build_dynamic_runtime_factory(cfg, job) if job.train.schedule == "dynamic" else None
    return apply_jitter(injector, jitter, rank, device), factory
