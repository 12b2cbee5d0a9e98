"""The body of one training process: under torchrun, under our launcher, or alone.

Reads the torch.distributed environment (RANK, WORLD_SIZE, LOCAL_RANK), picks this rank's role
(launch/roles.py: a plain rank here, a MegaFBD backward or forward worker in fbd/roles.py), builds
groups, data and (optionally) a MegaScan tracer, lets the role train, checkpoints, and on global
rank 0 shows progress and writes the metrics file.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from dataclasses import asdict, replace
from pathlib import Path

import torch
import torch.distributed as dist

from megatronapp.cli.metric_logs import build_metric_logs, eval_scalars, step_scalars
from megatronapp.cli.progress import TrainProgress
from megatronapp.cli.run import TrainRun
from megatronapp.cli.train_eval import RunEvaluations, build_eval_streams, describe_eval
from megatronapp.data.dataset import DistributedBatchIterator, build_default_dataset, build_text_dataset
from megatronapp.data.sources import build_datasets, compute_split_num_samples, uses_indexed_data
from megatronapp.data.tokenizer_types import build_tokenizer
from megatronapp.dpp.job_hooks import build_dpp_hooks
from megatronapp.engine.checkpoint import has_checkpoint, load_checkpoint, save_checkpoint
from megatronapp.engine.determinism import enable_deterministic_mode
from megatronapp.engine.trainer import Trainer
from megatronapp.files import write_text_atomic
from megatronapp.injection.inject import FaultInjector
from megatronapp.injection.link_delay import install_link_delays
from megatronapp.launch.roles import RankContext, TrainingRole, TrainLoop, backend_for, join_default_group
from megatronapp.parallel.device import select_device
from megatronapp.parallel.groups import ParallelGroups, build_process_groups, destroy_subgroups
from megatronapp.scope_ui.training import training_scope


def _build_data(run: TrainRun, tokenizer, groups):
    job = run.job
    seq, train = job.model.seq_length, job.train
    indexed = uses_indexed_data(run.data)
    if indexed:  # Megatron's samples, already shuffled: train_iters global batches of them
        num_samples = compute_split_num_samples(train.train_iters, train.global_batch_size)
        dataset = build_datasets(run.data, seq_length=seq, seed=train.seed, num_samples=num_samples).train
    elif run.data_paths:
        dataset = build_text_dataset(tokenizer, list(run.data_paths), seq)
    else:
        dataset = build_default_dataset(tokenizer, seq, train.seed)
    return DistributedBatchIterator(
        dataset,
        micro_batch_size=train.micro_batch_size,
        global_batch_size=train.global_batch_size,
        dp_rank=groups.dp_rank,
        dp_size=job.layout.dp_size,
        seed=train.seed,
        shuffle=not indexed,
    )


def _build_tracer(run: TrainRun, groups, device, meta_overrides=None):
    """MegaScan tracer + torch.distributed instrumentation, or (None, None) when off.
    meta_overrides: rank, world_size, role of an FBD rank (groups then describe its role)."""
    if not run.trace.enabled:
        return None, None
    from megatronapp.scan.record.format import build_rank_meta
    from megatronapp.scan.record.instrument import install_distributed_instrumentation
    from megatronapp.scan.record.tracer import Tracer

    job, over = run.job, meta_overrides or {}
    lay = job.layout
    meta = build_rank_meta(
        rank=over.get("rank", groups.rank),
        world_size=over.get("world_size", lay.world_size),
        coords=groups.coords.as_dict(),
        layout={
            "tp_size": lay.tp_size,
            "pp_size": lay.pp_size,
            "dp_size": lay.dp_size,
            "virtual_pp_size": lay.virtual_pp_size,
        },
        host=socket.gethostname(),
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        run_id=os.environ.get("MEGATRONAPP_RUN_ID", "local"),
        clock="cuda" if device.type == "cuda" else "monotonic",
        run={
            "model": asdict(job.model),
            "schedule": job.train.schedule,
            **run.injection.spec_dict,
            "dpp_traversal": run.dpp.traversal,
            "dpp_max_inflight": run.dpp.max_inflight,
            **({"role": over["role"]} if "role" in over else {}),
        },
    )
    skew = run.injection.clock_skew_of(meta["rank"])  # --inject-clock-skew: alignment tests
    tracer = Tracer(replace(run.trace, clock_skew_ns=skew), meta, device)
    return tracer, install_distributed_instrumentation(tracer)


class PlainRole:
    """A rank of a plain job: one engine Trainer (with MegaDPP's runtime when the schedule is dynamic)."""

    def __init__(self, run: TrainRun, rank: int):
        self.train_run, self.rank = run, rank
        self.device = select_device(run.device, int(os.environ.get("LOCAL_RANK", "0")))
        self.backend = backend_for(self.device)
        self.device_id = self.device if self.device.type == "cuda" else None
        self.trace_meta: dict = {}
        self.groups = self.trainer = None

    def build_groups(self) -> ParallelGroups:
        self.groups = build_process_groups(self.train_run.job.layout, self.rank)
        return self.groups

    def run(self, ctx: RankContext, train_loop: TrainLoop) -> list[dict]:
        run = self.train_run
        injector, runtime_factory = build_dpp_hooks(
            run.dpp, run.injection.jitter, ctx.job, self.rank, self.device, ctx.injector
        )
        self.trainer = Trainer(
            ctx.job,
            self.groups,
            self.device,
            ctx.data,
            injector=injector,
            runtime_factory=runtime_factory,
            **({"tracer": ctx.tracer} if ctx.tracer else {}),
        )
        return train_loop(self.trainer)

    def finish(self, summary_file: str | None) -> None:
        pass

    def close(self) -> None:
        if self.trainer is not None and hasattr(self.trainer.runtime, "close"):
            self.trainer.runtime.close()  # groups the runtime built (dpp/channels.py)


def pick_role(run: TrainRun, rank: int) -> TrainingRole:
    """This rank's role: plain, or under --forward-backward-disaggregating a backward or forward worker."""
    if run.fbd is not None:
        from megatronapp.fbd.roles import pick_fbd_role

        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", run.world_size))
        return pick_fbd_role(run.job, run.fbd, run.injection.fbd, run.device, run.world_size, rank, local_world)
    return PlainRole(run, rank)


def run_rank(run: TrainRun) -> list[dict]:
    """The body of one training process: train as rank RANK of the validated `run` (cli.main's
    `build_checked_run` builds and checks one from `train`'s flags); the metrics history (rank 0's)."""
    rank, job, plan = int(os.environ.get("RANK", "0")), run.job, run.injection.faults
    if job.integrity.deterministic:  # before any CUDA work and the process group (env read at creation)
        enable_deterministic_mode(os.environ)
    role = pick_role(run, rank)
    join_default_group(role, run.world_size, rank)
    tracer = instrumentation = link_delays = groups = None
    try:  # every exit path tears the process group down and flushes the trace
        groups = role.build_groups()
        tokenizer = build_tokenizer(run.data.tokenizer_type, run.data.tokenizer_model, run.data.vocab_size)
        data = _build_data(run, tokenizer, groups)
        eval_streams = build_eval_streams(run, tokenizer, groups)
        # Below the tracer's instrumentation, so traced recv spans see the late arrival.
        link_delays = install_link_delays(plan, rank) if role.device.type == "cpu" else None
        tracer, instrumentation = _build_tracer(run, groups, role.device, role.trace_meta)
        injector = None if plan.empty else FaultInjector(plan, rank, role.device)
        ctx = RankContext(job, data, injector, tracer)
        history = role.run(ctx, lambda trainer: _load_and_train(run, trainer, data, rank, eval_streams))
        role.finish(run.result_file)
        if tracer is not None:
            instrumentation.uninstall()  # the probe is not part of the job's trace
            instrumentation = None
            _probe_links(run, rank, role.device)
        return history
    finally:
        if instrumentation is not None:
            instrumentation.uninstall()
        if tracer is not None:
            tracer.close()
        if link_delays is not None:
            link_delays.uninstall()
        if run.injection.keep_process_group:
            role.close()
            destroy_subgroups(groups)
        elif dist.is_initialized():
            dist.destroy_process_group()


def _probe_links(run: TrainRun, rank: int, device: torch.device) -> None:
    """The link probe after the last iteration of a traced plain job (scan/probe_job.py); rank 0
    writes TRACE_DIR/probe.json. Under --trace-probe auto, only where the layout has a pipeline."""
    from megatronapp.scan.probe import compute_probe_pairs
    from megatronapp.scan.probe_job import probe_traced_job, should_probe

    layout = run.job.layout
    if run.fbd is None and layout.world_size > 1 and should_probe(run.trace.probe, layout.pp_size > 1):
        probe_traced_job(run.trace.trace_dir, compute_probe_pairs(layout), rank, device)


def _load_and_train(run: TrainRun, trainer, data, rank: int, eval_streams: dict | None = None) -> list[dict]:
    _maybe_load(run.job, trainer, data, rank)
    return _train_loop(run, trainer, data, rank, eval_streams or {})


def _maybe_load(job, trainer, data, rank: int) -> None:
    """Resume from --load; an empty or missing folder starts from scratch, as in Megatron."""
    load = job.checkpoint.load
    if not load:
        return
    if has_checkpoint(load):
        load_checkpoint(load, trainer, data)
    elif rank == 0:
        print(
            f"megatronapp: warning: --load {load} holds no checkpoint; starting from scratch",
            file=sys.stderr,
            flush=True,
        )


def _train_loop(run: TrainRun, trainer, data, rank: int, eval_streams: dict) -> list[dict]:
    from megatronapp.dpp.rebalance_hook import build_rebalance_hook
    from megatronapp.scan.analyze.detect_online import OnlineDetectConfig, OnlineDetector

    job = run.job
    ckpt, log = job.checkpoint, job.logging
    if log.metrics_file and rank == 0:
        Path(log.metrics_file).parent.mkdir(parents=True, exist_ok=True)
    metrics_out = open(log.metrics_file, "a") if (log.metrics_file and rank == 0) else None
    online = OnlineDetector(job.layout, OnlineDetectConfig()) if (rank == 0 and job.layout.world_size > 1) else None
    rebalance = build_rebalance_hook(run.dpp.rebalance, job, trainer)
    logs = build_metric_logs(job, rank, trainer.iteration + 1, asdict(job))
    history = []
    with TrainProgress(job, enabled=rank == 0, log_interval=log.log_interval) as progress:

        def on_step(metrics) -> None:
            m = metrics.as_dict()
            moved = rebalance.after_step(m) if rebalance else None
            if moved:
                progress.warn(moved, source="MegaDPP rebalance")
            history.append(m)
            progress.update(m)
            warning = online.update(m["iteration"], m["rank_compute_s"]) if online else None
            if warning:
                progress.warn(warning)
            if metrics_out:
                metrics_out.write(json.dumps(m) + "\n")
                metrics_out.flush()
            if logs:
                logs.log(m["iteration"], step_scalars(m))
            if ckpt.save and ckpt.save_interval and trainer.iteration % ckpt.save_interval == 0:
                save_checkpoint(ckpt.save, trainer, data)

        def on_eval_result(result) -> None:
            progress.note(describe_eval(result))
            if metrics_out:
                metrics_out.write(json.dumps(result.as_row()) + "\n")
                metrics_out.flush()
            if logs:
                logs.log(result.iteration, eval_scalars(result))
                logs.flush()

        evaluations = RunEvaluations(trainer, eval_streams, on_eval_result)
        with training_scope(run.scope, run.tokenizer_model, trainer, on_step) as on_step:  # unchanged unless --scope
            trainer.train(on_step=on_step, on_eval=evaluations.on_eval)
            evaluations.at_end()
    if ckpt.save and not (ckpt.save_interval and trainer.iteration % ckpt.save_interval == 0):
        save_checkpoint(ckpt.save, trainer, data)
    if metrics_out:
        metrics_out.close()
    if logs:
        logs.close()
    if rank == 0 and run.result_file:
        evals = [r.as_row() for r in evaluations.results]
        summary = {"layout": job.layout.describe(), "history": history, "evaluations": evals}
        write_text_atomic(run.result_file, json.dumps(summary))
    return history
