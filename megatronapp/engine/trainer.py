"""The training loop: one object that owns model chunks, optimizer, grads and the schedule.

One optimizer step = fetch this DP rank's microbatches, run the pipeline schedule
(forward/backward with DP reduction overlapped), reduce the gradients' global norm, clip,
AdamW step. Metrics stay on the device until the next log interval, then are gathered
with one all-reduce for the whole interval (no per-step host synchronisation).

Every step is checked (engine/integrity.py): a non-finite loss or grad norm skips the update
on the device and is named at the log interval, where the spiky-loss and large-grads bands
are applied too. A rerun mode (engine/rerun.py) instead checks each step before its update, on
the device, and re-executes a flagged step from the same weights at the log interval.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatronapp import spans
from megatronapp.config import JobConfig
from megatronapp.engine.determinism import check_deterministic_mode, deterministic_attention_backend
from megatronapp.engine.evaluation import EvalBatches, EvalResult, Evaluator
from megatronapp.engine.hooks import NULL_TRACER
from megatronapp.engine.integrity import StepHistory
from megatronapp.engine.mixed_precision import build_grads_and_optimizer
from megatronapp.engine.optim import compute_lr, set_lr
from megatronapp.engine.replica_split import check_job_split, compute_first_microbatch
from megatronapp.engine.rerun import StepValidator
from megatronapp.engine.throughput import compute_mfu, compute_tflops_per_device, peak_flops_for
from megatronapp.model.gpt import ChunkOptions, TPContext, apply_compile, build_model_chunks
from megatronapp.model.gpt_step import GPTPipelineModel
from megatronapp.parallel.fp8 import delayed_states, enable_fp8, update_delayed_scaling
from megatronapp.parallel.groups import ParallelGroups
from megatronapp.parallel.random import build_rng_tracker
from megatronapp.parallel.wgrad_defer import apply_split_backward
from megatronapp.pipeline.runtime import PipelineRuntime
from megatronapp.pipeline.schedules import build_schedule, schedule_has_weight_tasks
from megatronapp.pipeline.validate import validate_schedule

log = logging.getLogger("megatronapp.engine")


@dataclass(frozen=True)
class StepMetrics:
    iteration: int  # 1-based count of completed optimizer steps
    loss: float  # mean over microbatches and DP ranks
    lr: float
    grad_norm: float  # nan when the step was skipped (fp16 overflow)
    step_time_s: float  # mean over the log interval the step belongs to
    tokens_per_s: float
    tflops_per_gpu: float  # model FLOPs (engine/throughput.py convention) per device per second
    mfu: float | None  # against the device's dense bf16 peak; None where unknown (CPU)
    # forward+backward compute seconds of every global rank
    rank_compute_s: tuple[float, ...] = ()
    loss_scale: float | None = None  # fp16 / static loss scale in use for this step
    skipped_iterations: int = 0  # steps skipped for inf/nan grads so far (Megatron counts them)
    flags: tuple[str, ...] = ()  # the step's checks that failed (engine/integrity.py)
    # non-finite step: {"rank": r, "param": name or None, "loss_nonfinite": bool} for each rank
    # whose grads or loss were not finite
    nonfinite: tuple[dict, ...] = ()
    rerun: dict | None = None  # engine/rerun.py: {"flag", "verdict", "ranks"} or report_stats' deltas

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass(frozen=True)
class _PendingStep:
    """A finished step whose numbers are still on the device."""

    iteration: int
    lr: float
    loss: torch.Tensor | None  # this rank's share of the loss sum (last stage, TP rank 0)
    grad_norm: torch.Tensor
    compute: object  # ComputeTimer handle
    loss_scale: float | None
    skipped_iterations: int
    skipped_nonfinite: torch.Tensor | None = None  # device flag: update skipped for a non-finite value
    first_nonfinite: torch.Tensor | None = None  # index in optimizer.norm_params, see StepResult
    flags: tuple[str, ...] | None = None  # judged by the rerun mode (engine/rerun.py); None: at the log interval
    rerun: dict | None = None
    prepared: object = None  # the optimizer's PreparedStep (an update the rerun mode applies itself)
    check: object = None  # the rerun mode's record of the step (engine/rerun.py StepCheck)


class Trainer:
    def __init__(
        self,
        job: JobConfig,
        groups: ParallelGroups,
        device: torch.device,
        data,
        *,
        tracer=NULL_TRACER,
        injector=None,
        schedule=None,
        runtime_factory=None,
        clock=time.perf_counter,
        step_hook=None,
    ):
        self.job, self.groups, self.device, self.data = job, groups, device, data
        self.clock = clock  # seconds; a test passes a fake one
        # tests only: step_hook(iteration, attempt, loss, optimizer) -> loss, called between the
        # grads' reduction and the update (to corrupt a step); not a configuration
        self.step_hook = step_hook
        self.integrity = job.integrity
        self.step_history = StepHistory.build(job.integrity.check_window)
        self.validator = StepValidator(job.integrity) if job.integrity.rerun_mode != "disabled" else None
        # validate_results: an object with flagged(iteration, flags) (called while the flagged
        # execution's grads are in place), replaying(iteration) (a context manager around its
        # rerun) and classified(iteration, report); set by a module such as MegaScope's training view
        self.replay_observer = None
        # called with every EvalResult of evaluate() (e.g. by MegaScope's training view)
        self.eval_observer = None
        t = job.train
        attention_backend = t.attention_backend
        if job.integrity.deterministic:
            check_deterministic_mode()
            attention_backend = deterministic_attention_backend(attention_backend)
        self.rng_tracker = build_rng_tracker(t.seed, groups.tp_rank, groups.pp_rank, device)
        self.attention_backend = attention_backend
        self._runtime_args = (schedule, runtime_factory, injector)
        self.tracer = tracer
        # microbatches each DP replica runs (engine/replica_split.py); None: M each
        self.replica_microbatches: tuple[int, ...] | None = None
        self._build_model_and_runtime()
        self.iteration = 0  # optimizer steps completed
        self.peak_flops = peak_flops_for(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
        self.set_tracer(tracer)

    def _build_model_and_runtime(self) -> None:
        """Chunks, FP8 states, grad buffers, optimizer, pipeline model and runtime for `self.job`'s
        layout (and layer partition): everything that depends on which layers this rank holds."""
        job, groups, device = self.job, self.groups, self.device
        schedule = self._runtime_args[0]
        lay, t, attention_backend = job.layout, job.train, self.attention_backend
        tp = TPContext(groups.tp, lay.tp_size, groups.tp_rank, t.sequence_parallel)
        options = ChunkOptions(recompute=t.recompute_config(), rng_tracker=self.rng_tracker)
        self.chunks = build_model_chunks(
            job.model,
            pp_rank=groups.pp_rank,
            pp_size=lay.pp_size,
            num_chunks=lay.virtual_pp_size,
            tp=tp,
            seed=t.seed,
            device=device,
            options=options,
            stage_layers=lay.stage_layers,
        )
        prec = job.precision
        if prec.fp8_format is not None:
            in_fp8 = prec.fp8_layers(job.model.num_layers)
            enable_fp8(
                [block for c in self.chunks for i, block in c.layers.items() if int(i) in in_fp8],
                prec.fp8_format,
                prec.fp8_recipe,
                prec.fp8_amax_history_len,
            )
        # the delayed FP8 recipe's per-linear states, by layout-independent module name (checkpoints)
        self.fp8_states = delayed_states((name, m) for c in self.chunks for name, m in c.named_modules())
        if job.train.compile:
            apply_compile(self.chunks)
        self.reducer, self.optimizer = build_grads_and_optimizer(self.chunks, job, groups, device)
        self.model = GPTPipelineModel(
            self.chunks,
            job.model,
            seed=t.seed,
            dp_rank=groups.dp_rank,
            num_microbatches=job.num_microbatches,
            tp_size=lay.tp_size,
            tp_rank=groups.tp_rank,
            sequence_parallel=t.sequence_parallel,
            attention_backend=attention_backend,
        )
        # split backward: the linears' weight GEMMs wait for W tasks (parallel/wgrad_defer.py)
        split = t.uses_split_backward() or (schedule is not None and schedule_has_weight_tasks(schedule))
        if split:
            apply_split_backward(m for c in self.chunks for m in c.modules())
        self._split_backward = split
        self._build_runtime()
        names = {p: name for c in self.chunks for name, p in c.named_parameters()}
        self.norm_param_names = [names.get(p) for p in self.optimizer.norm_params]
        self._evaluator = None  # built at the first evaluation (of this model): a run without one pays nothing

    def _build_runtime(self) -> None:
        """The schedule and runtime for this replica's microbatch count (see set_replica_microbatches)."""
        job, groups, split = self.job, self.groups, self._split_backward
        schedule, runtime_factory, injector = self._runtime_args
        lay, count, uneven = job.layout, job.num_microbatches, {}
        if self.replica_microbatches is not None:
            count = self.replica_microbatches[groups.dp_rank]
            uneven = dict(loss_microbatches=job.num_microbatches)  # the balanced count: see replica_split.py
            self.model.first_microbatch = compute_first_microbatch(self.replica_microbatches, groups.dp_rank)
        else:
            self.model.first_microbatch = groups.dp_rank * count
        runtime_kw = dict(
            device=self.device,
            tracer=self.tracer,
            reducer=self.reducer,
            injector=injector,
            grad_scale_func=self.optimizer.scale_loss,
            split_backward=split,
            **uneven,
        )
        if runtime_factory is not None:  # decisions at run time (e.g. megatronapp.dpp): no static schedule
            kw = dict(num_microbatches=count) if uneven else {}
            self.schedule, self.runtime = None, runtime_factory(self.model, groups, **runtime_kw, **kw)
        else:
            self.schedule = schedule or build_schedule(job.train.schedule, lay.pp_size, lay.virtual_pp_size, count)
            validate_schedule(self.schedule)
            self.runtime = PipelineRuntime(self.model, groups, self.schedule, **runtime_kw)

    def set_replica_microbatches(self, split: tuple[int, ...] | None) -> None:
        """Between steps: DP replica r runs split[r] microbatches of each global batch from the next
        step on (None: the balanced M each), exactly (engine/replica_split.py). Every rank calls it
        with the same split; nothing is exchanged. ValueError (one line) for a split that does not fit."""
        if split is not None:
            if self._runtime_args[0] is not None:
                raise ValueError(
                    "a microbatch split needs a schedule the trainer builds (a given one has a fixed count)"
                )
            split = check_job_split(self.job, split)
        if hasattr(self.runtime, "close"):
            self.runtime.close()
        self.replica_microbatches = split
        self._build_runtime()
        self.set_tracer(self.tracer)

    def rebuild(self, job: JobConfig) -> None:
        """Rebuild every layer-dependent part for `job` (the same job in another layer partition);
        the parameters start from their initialisation: the caller loads the state
        (engine/repartition.py). The loop's own state (iteration, step checks, RNG streams) stays."""
        if hasattr(self.runtime, "close"):
            self.runtime.close()
        self.job = job
        self._build_model_and_runtime()
        self.set_tracer(self.tracer)

    def set_tracer(self, tracer) -> None:
        """Attach an observer (see engine.hooks) to the loop, the runtime and the model chunks."""
        self.tracer = self.runtime.tracer = tracer
        for c in self.chunks:
            c.tracer = None if tracer is NULL_TRACER else tracer

    def evaluate(self, name: str, batches: EvalBatches) -> EvalResult:
        """The loss of job.eval.eval_iters global batches of `batches` (forward only, eval mode;
        engine/evaluation.py). Collective: every rank of the job calls it."""
        if self._evaluator is None:
            self._evaluator = Evaluator(self, self.job.eval.eval_iters)
        result = self._evaluator.evaluate(name, batches)
        if self.eval_observer is not None:
            self.eval_observer(result)
        return result

    def train_step(self) -> StepMetrics:
        """One optimizer step, with its metrics known on the host (one synchronisation)."""
        t0 = self.clock()
        steps, on_host = self._settle([self._run_step()])  # the sync: the step has really finished after it
        return self._resolve(steps, on_host, self.clock() - t0)[-1]

    def _settle(self, steps: list[_PendingStep]) -> tuple[list[_PendingStep], torch.Tensor]:
        """The steps' host copy (see _copy_to_host); a rerun mode then settles them (a flagged step
        is executed again and the steps after it, whose updates it held, are dropped)."""
        on_host = self._copy_to_host(steps)
        if self.validator is None:
            return steps, on_host
        settled, rerun = self.validator.settle(self, steps)
        return settled, self._copy_to_host(settled) if rerun else on_host

    def _run_step(self) -> _PendingStep:
        """One optimizer step; its loss, grad norm and compute time stay on the device (a rerun
        mode reads them at once, see engine/rerun.py)."""
        if self.validator is not None:
            return self.validator.run_step(self)
        return self._execute_step()

    def _execute_step(self, attempt: int = 0, gate=None) -> _PendingStep:
        """One execution of the next optimizer step (`attempt` > 0: a rerun). `gate(loss, grad_norm,
        prepared)` (the rerun modes' check, engine/rerun.py) runs after the step's checks and before
        its update; it returns (apply, hold): apply False leaves the update to the caller (the
        grads stay in place), hold is a device flag that skips the update (or None)."""
        it = self.iteration
        self.tracer.step_begin(it)
        # skipped steps do not advance the schedule
        lr = compute_lr(it - self.optimizer.skipped_iterations, self.job.optimizer, self.job.train.train_iters)
        set_lr(self.optimizer, lr)
        self.reducer.zero_grad()
        split = () if self.replica_microbatches is None else (self.replica_microbatches,)
        microbatches = [mb.to(self.device, non_blocking=True) for mb in self.data.next_microbatches(*split)]
        loss = self.runtime.run(microbatches, iteration=it)
        with self.tracer.span(spans.GRAD_REDUCE, cat=spans.CAT_COMM):
            self.reducer.finish()
        if self.step_hook is not None:
            loss = self.step_hook(it, attempt, loss, self.optimizer)
        check = self.integrity.check_for_nan_in_loss_and_grad
        if self.fp8_states:  # the step's amaxes -> the next step's scales (one max-reduce over TP and DP)
            prec = self.job.precision
            update_delayed_scaling(self.fp8_states.values(), self.groups, prec.fp8_amax_compute_algo, prec.fp8_margin)
        loss = loss.detach().float() if loss is not None and self.groups.tp_rank == 0 else None
        with self.tracer.span(spans.OPTIMIZER):
            # unscale + inf check, norm, (non-finite check,) clip, AdamW, params update
            prepared = self.optimizer.prepare_step(check, self._loss_nonfinite(loss) if check else None)
            norm = prepared.grad_norm
            norm = torch.full((), float("nan"), device=self.device) if norm is None else norm.detach()
            apply, hold = (True, None) if gate is None else gate(loss, norm, prepared)
            if apply:
                self.optimizer.apply_step(prepared, hold)
        self.tracer.step_end(it)
        self.iteration += 1
        return _PendingStep(
            self.iteration,
            lr,
            loss,
            norm,
            self.runtime.compute_timer.take(),
            prepared.loss_scale,
            self.optimizer.skipped_iterations,
            prepared.skip,
            prepared.first_nonfinite,
            prepared=prepared,
        )

    def _loss_nonfinite(self, loss: torch.Tensor | None) -> torch.Tensor:
        """1.0 (a device flag, no host sync) where this rank's loss is not finite."""
        return torch.zeros((), device=self.device) if loss is None else (~torch.isfinite(loss.detach().float())).float()

    def _copy_to_host(self, steps: list[_PendingStep]) -> torch.Tensor:
        """(k, 4) host matrix of the steps' loss share, grad norm, non-finite skip flag and first
        non-finite parameter: the one device->host copy,
        which waits for the device to finish the steps (the end of an interval's time)."""
        zero = torch.zeros((), device=self.device)
        return torch.stack(
            [
                torch.stack(
                    [
                        zero if st.loss is None else st.loss,
                        st.grad_norm.float(),
                        zero if st.skipped_nonfinite is None else st.skipped_nonfinite,
                        zero if st.first_nonfinite is None else st.first_nonfinite.float(),
                    ]
                )
                for st in steps
            ]
        ).cpu()

    def _resolve(self, steps: list[_PendingStep], on_host: torch.Tensor, elapsed_s: float) -> list[StepMetrics]:
        """Metrics of `steps` on every rank from their host copy (see _copy_to_host) and one all-reduce.

        Row i of a (k, 1 + world) host matrix: slot 0 sums the loss of the last stage's TP-rank-0
        ranks, slot 1 + r carries rank r's compute seconds (zero elsewhere). The matrix is built
        on the host so that the only transfers are the device numbers' one copy out and, with
        several ranks, the all-reduce (pageable single-element copies each stall the GPU queue).
        `elapsed_s` is read after the copy, so it spans the steps' device time.
        """
        world = self.job.layout.world_size
        values = torch.zeros(len(steps), 1 + world, dtype=torch.float32)
        values[:, 0] = on_host[:, 0]
        for i, st in enumerate(steps):
            values[i, 1 + self.groups.rank] = self.runtime.compute_timer.resolve(st.compute)
        if world > 1:
            reduced = values.to(self.device)
            dist.all_reduce(reduced, group=self.groups.world)
            values = reduced.cpu()
        rows, norms = values.tolist(), on_host[:, 1].tolist()
        dt = elapsed_s / len(steps)
        tokens_per_s = self.job.train.global_batch_size * self.job.model.seq_length / dt
        tflops = compute_tflops_per_device(self.job.model.flops_per_token(), tokens_per_s, world)
        skipped = on_host[:, 2].cumsum(0).long().tolist()  # device skips, counted here (on the host)
        nonfinite = self._name_nonfinite(steps, on_host) if skipped[-1] else {}
        self.optimizer.skipped_iterations += skipped[-1]
        out = []
        for i, (st, row, norm) in enumerate(zip(steps, rows, norms)):
            loss = row[0] / self.job.layout.dp_size
            flags = st.flags if st.flags is not None else self._judge(loss, norm, skipped_here=on_host[i, 2] > 0)
            out.append(
                StepMetrics(
                    st.iteration,
                    loss,
                    st.lr,
                    norm,
                    dt,
                    tokens_per_s,
                    tflops,
                    compute_mfu(tflops, self.peak_flops),
                    tuple(row[1:]),
                    st.loss_scale,
                    st.skipped_iterations + skipped[i],
                    flags,
                    nonfinite.get(i, ()),
                    st.rerun,
                )
            )
        return out

    def _judge(self, loss: float, norm: float, skipped_here: bool) -> tuple[str, ...]:
        """A step's flags at the log interval; a step skipped as non-finite on any rank is "nan"
        on every rank (this rank's own values may be finite)."""
        return ("nan",) if skipped_here else self.step_history.judge(loss, norm, self.integrity)

    def _name_nonfinite(self, steps: list[_PendingStep], on_host: torch.Tensor) -> dict[int, tuple[dict, ...]]:
        """Per skipped step (by index in `steps`): the ranks whose grads or loss were not finite,
        with the first such parameter. Collective: every rank sees the same skip flags."""
        mine = {}
        for i, st in enumerate(steps):
            if on_host[i, 2] > 0:
                index = int(on_host[i, 3])
                param = self.norm_param_names[index] if index < len(self.norm_param_names) else None
                loss_bad = st.loss is not None and not math.isfinite(on_host[i, 0].item())
                if param is not None or loss_bad:
                    mine[i] = {"rank": self.groups.rank, "param": param, "loss_nonfinite": loss_bad}
        everyone = [mine]
        if self.job.layout.world_size > 1:
            everyone = [None] * self.job.layout.world_size
            dist.all_gather_object(everyone, mine, group=self.groups.world)
        named = {i: tuple(r[i] for r in everyone if i in r) for i in range(len(steps)) if on_host[i, 2] > 0}
        if self.groups.rank == 0:
            for i, found in named.items():
                log.warning(
                    "iteration %d: non-finite loss or gradients, update skipped: %s",
                    steps[i].iteration,
                    "; ".join(f"rank {f['rank']} {f['param'] or 'loss'}" for f in found) or "unknown",
                )
        return named

    def train(self, num_steps: int | None = None, on_step=None, on_eval=None) -> list[StepMetrics]:
        """Run until train_iters (or num_steps more steps); on_step(metrics) for every step.

        Metrics reach the host only every `log_interval` steps (and at the end): between
        them nothing waits for the device. Step time is the interval's mean, over the time
        from the previous interval's sync to this one's: the host running ahead of the device
        is not counted as progress, and the intervals tile the run (host work between them,
        such as on_step and checkpoints, falls in the next interval).

        on_eval(iteration), when given, runs after every `eval_interval`-th step (engine/evaluation.py).
        It does not move the log intervals (the learning rate learns of skipped steps there, so an
        earlier report would change training); its time is left out of the step times, as Megatron
        stops its interval timer around evaluation.
        """
        end = self.job.train.train_iters if num_steps is None else self.iteration + num_steps
        interval, eval_interval = self.job.logging.log_interval, self.job.eval.eval_interval
        if self.validator is not None and self.replay_observer is not None:
            interval = 1  # the observer reads a flagged execution's grads before the next step replaces them
        history, pending, t0 = [], [], self.clock()
        while self.iteration < end:
            pending.append(self._run_step())
            if self.iteration % interval == 0 or self.iteration == end:
                pending, on_host = self._settle(pending)
                t1 = self.clock()
                for m in self._resolve(pending, on_host, t1 - t0):
                    history.append(m)
                    if on_step is not None:
                        on_step(m)
                pending, t0 = [], t1
            if on_eval is not None and self.iteration % eval_interval == 0:
                t0 += self._timed(on_eval, self.iteration)
        self.optimizer.finish_param_sync()  # --overlap-param-gather: params complete on return
        return history

    def _timed(self, fn, *args) -> float:
        """Seconds `fn` took, from the moment the device had finished the work queued before it."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        start = self.clock()
        fn(*args)
        return self.clock() - start
