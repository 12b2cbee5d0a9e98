"""Engine II on one GPU: Megatron bf16 engine vs a plain pure-bf16 compiled GPT, recompute,
and the largest micro-batch that fits.

    python benchmarks/engine_bench.py --only throughput,microbatch --out engine.json
    python benchmarks/engine_bench.py --only recompute --out recompute.json
    python benchmarks/engine_bench.py --only throughput,fp8_loss --out fp8.json
    python benchmarks/engine_bench.py --preset llama3.2-1b --only throughput --out llama.json
    python benchmarks/engine_bench.py --only family_loss --loss-steps 200 --out family_loss.json

throughput: the engine (--bf16: bf16 params, fp32 main grads and master weights, parallel
layers, schedule runtime, clipping, distributed optimizer, compiled blocks) and the plain
twin (benchmarks/plain_gpt.py, pure bf16 params and AdamW, one torch.compile) in one
process, rounds interleaved (A B A B ...), median and spread of the per-step time.
Peak memory per variant = its resident state (measured when it was built and stepped once)
+ the transient peak of its own step (max allocated during the step - allocated before).
recompute: none / selective / full (uniform, 1 layer) engines, compiled, interleaved.
microbatch: the largest micro-batch (eager) whose step fits, with and without full recompute.
fp8_loss: the engine in bf16 and with --fp8-format hybrid, same init and corpus batches, loss per step.
family_loss: the engine on each of --loss-presets (GPT-NeoX 1.3b, Llama-shaped llama3.2-1b), loss per step;
with --loss-twin each preset's plain twin (fp32 params, bf16 autocast, the same AdamW settings and
learning-rate schedule) on the same batches too, to tell a loss bump the batches cause from one the engine does.
--preset llama3.2-1b: every bench on the Llama-shaped model, against a Llama-shaped plain twin.
integrity variants (--variants): engine_no_checks (--no-check-for-nan-in-loss-and-grad), engine_checks
(+ --check-for-spiky-loss --check-for-large-grads), engine_rerun (+ --rerun-mode validate_results: checks
on the device before the update, a replay point per step, no sync), engine_deterministic (--deterministic; torch's deterministic switch is on
only while that variant builds and steps, CUBLAS_WORKSPACE_CONFIG is set for the whole process).
precision-aware variants (--variants, engine/precision_adam.py): engine_pa_remainders (fp32 masters as bf16
weights + 16-bit remainders, fp32 moments), engine_pa_bf16_moments (remainders + bf16 moments),
engine_pa_fp32_masters_bf16_moments (separate fp32 masters, bf16 moments), engine_pa_fp16_masters_bf16_moments,
engine_pa_bf16_grads (remainders, bf16 moments and bf16 main grads: 10 bytes a parameter), and the hybrid FP8
engine_fp8_pa_bf16_moments and engine_fp8_pa_bf16_grads; plain_fp8_torchao: the plain twin with torchao's
float8 training (tensorwise), where torchao imports.

split: the B/W split's cost on a PP1 step (no bubbles to fill there): the engine with the
whole backward vs --split-backward (I then W right after it), both eager (the split refuses
--compile), rounds interleaved.
phases: forward+backward and the optimizer phase of each variant timed apart (profile, timeline:
kernel sums and GPU idle time of one or two steps).
MFU convention: engine/throughput.py (6N without the input embedding + 12*L*H*S) / 989 TFLOP/s.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import make_job as make_bench_job
from plain_gpt import PlainGPT

from megatronapp.config import IntegrityConfig, JobConfig
from megatronapp.engine.determinism import compute_deterministic_env
from megatronapp.engine.trainer import Trainer
from megatronapp.job import replace_fields
from megatronapp.model.gpt import compile_counts
from megatronapp.parallel.groups import single_process_groups

PEAK = 989e12
# fp8_loss: the runs beside bf16 (--loss-variants), each a precision override
LOSS_VARIANTS = {
    "bf16": {},
    "fp8_hybrid": {"fp8_format": "hybrid"},
    "fp8_hybrid_delayed": {"fp8_format": "hybrid", "fp8_recipe": "delayed"},
}
DEV = torch.device("cuda")
PRECISION_AWARE = {"use_precision_aware_optimizer": True}
BF16_MOMENTS = {"exp_avg_dtype": "bf16", "exp_avg_sq_dtype": "bf16"}
PRECISION_AWARE_VARIANTS = {
    "engine_pa_remainders": {},
    "engine_pa_bf16_moments": BF16_MOMENTS,
    "engine_pa_fp32_masters_bf16_moments": {"store_param_remainders": False, **BF16_MOMENTS},
    "engine_pa_fp16_masters_bf16_moments": {"main_params_dtype": "fp16", **BF16_MOMENTS},
    "engine_pa_bf16_grads": {"main_grads_dtype": "bf16", **BF16_MOMENTS},
}


class Batches:
    def __init__(self, vocab: int, micro_batch: int, seq: int, num_micro: int):
        self.mbs = [torch.randint(0, vocab, (micro_batch, seq + 1), device=DEV) for _ in range(num_micro)]

    def next_microbatches(self):
        return self.mbs

    # The rerun validator (engine_rerun) keeps and puts back the data position; these
    # batches are the same every step, so there is no position to keep.
    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


PRESET = "1.3b"  # --preset: the model every bench builds (llama3.2-1b: the Llama-shaped one)


def make_job(micro_batch: int, num_micro: int, preset: str | None = None, **train_kw) -> JobConfig:
    return make_bench_job(
        preset or PRESET,
        micro_batch,
        num_micro,
        model_overrides={"vocab_size": 50304},
        bf16=True,
        use_distributed_optimizer=True,
        log_interval=10**6,
        **train_kw,
    )


class PlainRunner:
    """Pure bf16: bf16 params and AdamW state, no autocast, no master weights."""

    def __init__(self, job: JobConfig, data: Batches, float8: bool = False):
        self.model = PlainGPT(job.model, DEV).to(torch.bfloat16)
        if float8:  # torchao's float8 training: its linears' GEMMs in FP8, tensorwise scaling
            from torchao.float8 import convert_to_float8_training

            convert_to_float8_training(
                self.model, module_filter_fn=lambda mod, fqn: fqn != "head"
            )  # as the engine: output layer bf16
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, fused=True)
        self.compiled = torch.compile(self.model)
        self.data = data

    def steps(self, n: int) -> None:
        for _ in range(n):
            self.step()

    def step(self) -> None:
        self.opt.zero_grad(set_to_none=True)
        for mb in self.data.mbs:
            (self.compiled(mb[:, :-1], mb[:, 1:]) / len(self.data.mbs)).backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0, foreach=True)
        self.opt.step()


def _timed_steps(run, n: int) -> tuple[float, float]:
    """(seconds per step, transient peak bytes) over n steps; run(n) takes n steps with no
    host synchronisation between them (the engine resolves its metrics once, at the end)."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    run(n)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n, torch.cuda.max_memory_allocated() - before


def _delta(after: dict, before: dict) -> dict:
    return {k: after[k] - before[k] for k in after}


def _interleave(variants: dict, args) -> dict:
    resident, built, compiled = {}, {}, {}
    for name, factory in variants.items():
        torch.cuda.synchronize()
        before, counts = torch.cuda.memory_allocated(), compile_counts()
        step = factory()
        step(args.warmup)
        torch.cuda.synchronize()
        resident[name] = torch.cuda.memory_allocated() - before
        built[name], compiled[name] = step, _delta(compile_counts(), counts)
        print(f"built {name}: resident {resident[name] / 2**30:.1f} GiB, dynamo {compiled[name]}", flush=True)
    times, transient = {k: [] for k in built}, dict.fromkeys(built, 0)
    in_rounds = {k: {"frames": 0, "graph_breaks": 0} for k in built}
    for r in range(args.rounds):
        for name, step in built.items():
            counts = compile_counts()
            t, peak = _timed_steps(step, args.steps)
            new = _delta(compile_counts(), counts)
            in_rounds[name] = {k: in_rounds[name][k] + new[k] for k in new}
            times[name].append(t)
            transient[name] = max(transient[name], peak)
        print(f"round {r}: " + ", ".join(f"{k} {v[-1] * 1e3:.1f} ms" for k, v in times.items()), flush=True)
    out = {}
    for name, ts in times.items():
        med = statistics.median(ts)
        if any(in_rounds[name].values()):
            print(f"warning: {name}: dynamo compiled during the timed rounds: {in_rounds[name]}", flush=True)
        out[name] = {
            "step_s": med,
            "spread": (max(ts) - min(ts)) / med,
            "rounds_s": ts,
            "resident_gib": resident[name] / 2**30,
            "dynamo_while_built": compiled[name],
            "dynamo_in_rounds": in_rounds[name],
            "peak_gib": (resident[name] + transient[name]) / 2**30,
        }
    return out


def _annotate(out: dict, job: JobConfig) -> None:
    tokens = job.train.global_batch_size * job.model.seq_length
    for v in out.values():
        v["tokens_per_s"] = tokens / v["step_s"]
        v["mfu"] = job.model.flops_per_token() * tokens / v["step_s"] / PEAK


def _engine_factory(job: JobConfig, data: Batches):
    def build():
        trainer = Trainer(job, single_process_groups(), DEV, data)
        return lambda n: trainer.train(num_steps=n)

    return build


def _deterministic(build):
    """A factory whose trainer is built and stepped with torch's deterministic switches on
    (process-wide state, so switched back off around the other variants' steps)."""

    def switched(on: bool) -> None:
        torch.use_deterministic_algorithms(on)
        torch.backends.cudnn.deterministic = on

    def factory():
        switched(True)
        try:
            run = build()
        finally:
            switched(False)

        def step(n: int):
            switched(True)
            try:
                return run(n)
            finally:
                switched(False)

        return step

    return factory


CHECKS = dict(check_for_spiky_loss=True, check_for_large_grads=True)


def _variants(job: JobConfig, data: Batches) -> dict:
    """name -> factory of a step function: the engine as measured, its alternatives, the twin."""

    def engine(integrity: dict | None = None, **kw):
        checked = replace(replace_fields(job, **kw), integrity=IntegrityConfig(**(integrity or {})))
        return _engine_factory(checked, data)

    return {
        "engine": engine(),
        "engine_no_checks": engine({"check_for_nan_in_loss_and_grad": False}),
        "engine_checks": engine(CHECKS),
        "engine_rerun": engine({**CHECKS, "rerun_mode": "validate_results"}),
        "engine_deterministic": _deterministic(engine({"deterministic": True})),
        "engine_torch_adamw": engine(fused_master_adamw=False),
        "engine_overlap_update": engine(overlap_param_update=True),
        "engine_fp8": engine(fp8_format="hybrid"),
        "engine_fp8_e4m3": engine(fp8_format="e4m3"),
        "engine_fp8_first_last_bf16": engine(fp8_format="hybrid", first_last_layers_bf16=True),
        "engine_fp8_delayed": engine(fp8_format="hybrid", fp8_recipe="delayed"),
        **{name: engine(**PRECISION_AWARE, **kw) for name, kw in PRECISION_AWARE_VARIANTS.items()},
        "engine_fp8_pa_bf16_moments": engine(fp8_format="hybrid", **PRECISION_AWARE, **BF16_MOMENTS),
        "engine_fp8_pa_bf16_grads": engine(
            fp8_format="hybrid", main_grads_dtype="bf16", **PRECISION_AWARE, **BF16_MOMENTS
        ),
        "plain_bf16": lambda: PlainRunner(job, data).steps,
        **({"plain_fp8_torchao": lambda: PlainRunner(job, data, float8=True).steps} if _has_torchao() else {}),
    }


def _has_torchao() -> bool:
    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        return False
    return True


def _selected(variants: dict, args, default: tuple[str, ...]) -> dict:
    """The variants named by --variants (default: `default`); plain_bf16 always runs."""
    names = args.variants.split(",") if args.variants else list(default)
    unknown = set(names) - set(variants)
    if unknown:
        raise SystemExit(f"engine_bench: unknown or unavailable variants {sorted(unknown)}; have {sorted(variants)}")
    return {k: v for k, v in variants.items() if k in names or k == "plain_bf16"}


def bench_throughput(args, results: dict) -> None:
    job = make_job(4, args.num_micro, compile=True)
    data = Batches(job.model.padded_vocab_size, 4, job.model.seq_length, args.num_micro)
    variants = _selected(_variants(job, data), args, ("engine", "engine_fp8"))
    out = _interleave(variants, args)
    _annotate(out, job)
    for name in [v for v in variants if v != "plain_bf16"]:
        out[f"{name}_vs_plain"] = out["plain_bf16"]["step_s"] / out[name]["step_s"]
    results["throughput"] = out


def bench_fp8_loss(args, results: dict) -> None:
    """What FP8 does to training: the engine in bf16 and in bf16 + FP8 (hybrid, E4M3 / E5M2)
    from the same initialisation on the same batches of the embedded corpus, loss per step."""
    out = {}
    for name in ["bf16"] + [v for v in args.loss_variants.split(",") if v != "bf16"]:
        kw = LOSS_VARIANTS[name]
        job = make_job(4, args.num_micro, compile=True, **kw)
        job = replace_fields(job, lr=3e-4, lr_warmup_iters=10, train_iters=args.loss_steps)
        trainer = Trainer(job, single_process_groups(), DEV, _family_batches(job))
        out[name] = [float(trainer.train_step().loss) for _ in range(args.loss_steps)]
        print(f"  {name}: loss {out[name][0]:.4f} -> {out[name][-1]:.4f}", flush=True)
        del trainer
        gc.collect()
        torch.cuda.empty_cache()
    tail = max(1, args.loss_steps // 10)
    last = {k: statistics.mean(v[-tail:]) for k, v in out.items()}
    results["fp8_loss"] = {
        "losses": out,
        f"mean_of_last_{tail}": last,
        "minus_bf16": {k: last[k] - last["bf16"] for k in last if k != "bf16"},
        "max_abs_step_difference": {
            k: max(abs(a - b) for a, b in zip(out["bf16"], v)) for k, v in out.items() if k != "bf16"
        },
    }


def _family_batches(job: JobConfig):
    """The embedded corpus's batches as the engine's single-process run reads them."""
    from megatronapp.data.dataset import DistributedBatchIterator, build_default_dataset
    from megatronapp.data.tokenizer import ByteTokenizer

    return DistributedBatchIterator(
        build_default_dataset(ByteTokenizer(), job.model.seq_length, job.train.seed),
        micro_batch_size=4,
        global_batch_size=job.train.global_batch_size,
        dp_rank=0,
        dp_size=1,
        seed=job.train.seed,
    )


def _plain_twin_losses(job: JobConfig, steps: int) -> list[float]:
    """The plain twin (fp32 params, bf16 autocast, torch AdamW with the engine's hyper-parameters
    and learning-rate schedule, clipping) on the engine's batches: what the recipe does to a loss
    curve without the engine's code. Its initialisation is its own (torch's defaults)."""
    from plain_gpt import plain_train_step

    from megatronapp.engine.optim import compute_lr, set_lr

    torch.manual_seed(job.train.seed)
    model = PlainGPT(job.model, DEV)
    cfg = job.optimizer
    params = list(model.parameters())
    groups = [  # as the engine: no decay on biases and norms
        {"params": [q for q in params if q.ndim >= 2], "weight_decay": cfg.weight_decay},
        {"params": [q for q in params if q.ndim < 2], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(
        groups,
        lr=cfg.lr,
        betas=(cfg.adam_beta1, cfg.adam_beta2),
        eps=cfg.adam_eps,
        fused=True,
    )
    compiled, data, losses = torch.compile(model), _family_batches(job), []
    for i in range(steps):
        set_lr(opt, compute_lr(i, cfg, steps))
        mbs = [mb.to(DEV) for mb in data.next_microbatches()]
        losses.append(plain_train_step(compiled, opt, mbs, clip=cfg.clip_grad))
    return losses


def bench_family_loss(args, results: dict) -> None:
    """Loss per step of each --loss-presets model (the engine, bf16, compiled) from the same
    seed on the same batches of the embedded corpus: the Llama-shaped preset against GPT-NeoX's;
    with --loss-twin, each preset's plain twin on the same batches too (key PRESET/plain)."""
    out = {}
    for preset in args.loss_presets.split(","):
        job = make_job(4, args.num_micro, preset=preset, compile=True)
        job = replace_fields(job, lr=3e-4, lr_warmup_iters=10, train_iters=args.loss_steps)
        trainer = Trainer(job, single_process_groups(), DEV, _family_batches(job))
        out[preset] = [float(trainer.train_step().loss) for _ in range(args.loss_steps)]
        print(f"  {preset}: loss {out[preset][0]:.4f} -> {out[preset][-1]:.4f}", flush=True)
        del trainer
        gc.collect()
        torch.cuda.empty_cache()
        if args.loss_twin:
            twin = out[f"{preset}/plain"] = _plain_twin_losses(job, args.loss_steps)
            print(f"  {preset}/plain: loss {twin[0]:.4f} -> {twin[-1]:.4f}", flush=True)
            gc.collect()
            torch.cuda.empty_cache()
    tail = max(1, args.loss_steps // 10)
    results["family_loss"] = {
        "losses": out,
        f"mean_of_last_{tail}": {k: statistics.mean(v[-tail:]) for k, v in out.items()},
        f"stdev_of_last_{tail}": {k: statistics.stdev(v[-tail:]) if tail > 1 else 0.0 for k, v in out.items()},
    }


def bench_split(args, results: dict) -> None:
    # micro-batch 2: both eager engines (states and activations) are resident at once
    job = make_job(2, args.num_micro, split_backward=False)
    data = Batches(job.model.padded_vocab_size, 2, job.model.seq_length, args.num_micro)
    variants = {
        "engine_eager": _engine_factory(job, data),
        "engine_eager_split": _engine_factory(replace_fields(job, split_backward=True), data),
    }
    out = _interleave(variants, args)
    _annotate(out, job)
    out["split_cost"] = out["engine_eager_split"]["step_s"] / out["engine_eager"]["step_s"] - 1.0
    results["split"] = out


def bench_recompute(args, results: dict) -> None:
    base = make_job(4, args.num_micro, compile=True)
    data = Batches(base.model.padded_vocab_size, 4, base.model.seq_length, args.num_micro)
    variants = {}
    for name, kw in (
        ("none", {}),
        ("selective", {"recompute_granularity": "selective"}),
        ("full", {"recompute_granularity": "full"}),
    ):
        variants[name] = _engine_factory(replace_fields(base, **kw), data)
    out = _interleave(variants, args)
    _annotate(out, base)
    results["recompute"] = out


def _largest_micro_batch(job: JobConfig, sizes: list[int]) -> int:
    trainer = Trainer(job, single_process_groups(), DEV, None)
    best = 0
    for b in sizes:
        trainer.data = Batches(job.model.padded_vocab_size, b, job.model.seq_length, job.num_microbatches)
        try:
            trainer.train(num_steps=1)
            torch.cuda.synchronize()
            best = b
            print(f"  micro-batch {b}: fits", flush=True)
        except torch.cuda.OutOfMemoryError:
            print(f"  micro-batch {b}: out of memory", flush=True)
            break
        finally:
            trainer.data = None
            gc.collect()
            torch.cuda.empty_cache()
    del trainer
    gc.collect()
    torch.cuda.empty_cache()
    return best


def bench_microbatch(args, results: dict) -> None:
    sizes = [4, 8, 12, 16, 24, 32, 48, 64]
    out = {}
    for name, kw in (("none", {}), ("full", {"recompute_granularity": "full"})):
        job = make_job(4, 1, **kw)
        out[name] = _largest_micro_batch(job, sizes)
    results["largest_micro_batch_eager"] = out


def _kernel_category(name: str) -> str:
    n = name.lower()
    for cat, keys in (
        ("gemm", ("gemm", "sm90_xmma", "cutlass", "nvjet", "matmul")),
        ("attention", ("flash", "fmha", "attention", "cudnn")),
        ("optimizer", ("multi_tensor", "adam", "foreach")),
        ("triton", ("triton",)),
        ("copy/cast", ("copy", "cast", "convert")),
        ("reduce", ("reduce",)),
    ):
        if any(k in n for k in keys):
            return cat
    return "other elementwise"


def _warm_variants(args):
    """(name, step function) of the engine and the plain twin, one at a time, each warmed up
    and synchronised; each is freed before the next is built."""
    job = make_job(4, args.num_micro, compile=True)
    data = Batches(job.model.padded_vocab_size, 4, job.model.seq_length, args.num_micro)
    for name, factory in _selected(_variants(job, data), args, ("engine",)).items():
        step = factory()
        step(args.warmup + 1)
        torch.cuda.synchronize()
        yield name, step
        del step
        gc.collect()
        torch.cuda.empty_cache()


def bench_profile(args, results: dict) -> None:
    """GPU kernel time per category for one step of the engine and of the plain twin."""
    from torch.profiler import ProfilerActivity, profile

    out = {}
    for name, step in _warm_variants(args):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step(1)
            torch.cuda.synchronize()
        cats: dict[str, float] = {}
        kernels = []
        for evt in prof.key_averages():
            t = evt.device_time_total / 1e3  # ms
            if t <= 0:
                continue
            cats[_kernel_category(evt.key)] = cats.get(_kernel_category(evt.key), 0.0) + t
            kernels.append((t, evt.count, evt.key[:120]))
        kernels.sort(reverse=True)
        out[name] = {"categories_ms": cats, "total_ms": sum(cats.values()), "top": kernels[:40]}
        print(name, json.dumps(out[name], indent=1), flush=True)
    results["profile"] = out


def _busy_and_gaps(trace_path: str, top: int = 30) -> dict:
    """GPU busy time (union of kernel / memcpy / memset intervals) and the idle gaps between
    them in a chrome trace, largest first, with the names around each gap."""
    events = json.loads(Path(trace_path).read_text())["traceEvents"]
    dev = sorted(
        (e["ts"], e["ts"] + e.get("dur", 0), e["name"])
        for e in events
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
    )
    if not dev:
        return {}
    busy, gaps, end, last = 0.0, [], dev[0][0], dev[0][2]
    for t0, t1, name in dev:
        if t0 > end:
            gaps.append((t0 - end, last[:60], name[:60]))
        busy += max(0.0, t1 - max(t0, end))
        if t1 > end:
            end, last = t1, name
    gaps.sort(reverse=True)
    span = end - dev[0][0]
    return {
        "window_ms": span / 1e3,
        "busy_ms": busy / 1e3,
        "idle_ms": (span - busy) / 1e3,
        "gaps_over_20us": sum(1 for g in gaps if g[0] > 20),
        "idle_in_gaps_over_20us_ms": sum(g[0] for g in gaps if g[0] > 20) / 1e3,
        "kernels": len(dev),
        "largest_gaps_us": [(round(g, 1), a, b) for g, a, b in gaps[:top]],
    }


def bench_timeline(args, results: dict) -> None:
    """CPU+CUDA timeline of two steps of each variant: where the GPU sits idle inside a step."""
    from torch.profiler import ProfilerActivity, profile

    out = {}
    for name, step in _warm_variants(args):
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step(2)
            torch.cuda.synchronize()
        with tempfile.TemporaryDirectory() as tmp:
            path = str(Path(tmp) / "trace.json")
            prof.export_chrome_trace(path)
            out[name] = _busy_and_gaps(path)
        print(name, json.dumps(out[name], indent=1), flush=True)
        del prof
    results["timeline"] = out


def _engine_phases(trainer: Trainer, data: Batches):
    """One engine step split at the end of backward: (forward+backward s, reduce+optimizer s)."""

    def run() -> tuple[float, float]:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        trainer.reducer.zero_grad()
        trainer.runtime.run(data.mbs, iteration=trainer.iteration)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        trainer.reducer.finish()
        trainer.optimizer.step()
        torch.cuda.synchronize()
        trainer.iteration += 1
        trainer.runtime.compute_timer.take()
        return t1 - t0, time.perf_counter() - t1

    return run


def _plain_phases(plain: PlainRunner):
    def run() -> tuple[float, float]:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        plain.opt.zero_grad(set_to_none=True)
        for mb in plain.data.mbs:
            (plain.compiled(mb[:, :-1], mb[:, 1:]) / len(plain.data.mbs)).backward()
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(plain.model.parameters(), 1.0, foreach=True)
        plain.opt.step()
        torch.cuda.synchronize()
        return t1 - t0, time.perf_counter() - t1

    return run


def bench_phases(args, results: dict) -> None:
    """Where the engine's extra step time is: forward+backward and the optimizer phase timed
    apart (a device sync between them), both variants built at once, rounds interleaved."""
    job = make_job(4, args.num_micro, compile=True)
    data = Batches(job.model.padded_vocab_size, 4, job.model.seq_length, args.num_micro)
    trainer, plain = Trainer(job, single_process_groups(), DEV, data), PlainRunner(job, data)
    trainer.train(args.warmup)
    plain.steps(args.warmup)
    runs = {"engine": _engine_phases(trainer, data), "plain_bf16": _plain_phases(plain)}
    times = {name: [] for name in runs}
    for _ in range(args.rounds):
        for name, run in runs.items():
            times[name].extend(run() for _ in range(args.steps))
    out = {}
    for name, ts in times.items():
        fb, opt = [t[0] for t in ts], [t[1] for t in ts]
        out[name] = {
            "forward_backward_ms": statistics.median(fb) * 1e3,
            "optimizer_ms": statistics.median(opt) * 1e3,
            "forward_backward_range_ms": [min(fb) * 1e3, max(fb) * 1e3],
            "optimizer_range_ms": [min(opt) * 1e3, max(opt) * 1e3],
            "samples": len(ts),
        }
    results["phases"] = out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="engine_bench.json")
    p.add_argument("--only", default="throughput,microbatch")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--num-micro", type=int, default=2)
    p.add_argument(
        "--variants",
        default="",
        help="throughput (default engine,engine_fp8), profile, timeline: "
        "comma-separated subset of engine, engine_no_checks, engine_checks, engine_rerun, "
        "engine_deterministic, engine_torch_adamw, engine_overlap_update, engine_fp8, "
        "engine_fp8_e4m3, engine_fp8_first_last_bf16, engine_fp8_delayed (plain_bf16 always runs)",
    )
    p.add_argument("--preset", default=PRESET, help="model preset of every bench but family_loss (vocabulary 50304)")
    p.add_argument("--loss-steps", type=int, default=100, help="fp8_loss, family_loss: steps of each run")
    p.add_argument(
        "--loss-presets", default="1.3b,llama3.2-1b", help="family_loss: the presets trained, one after the other"
    )
    p.add_argument(
        "--loss-twin",
        action="store_true",
        help="family_loss: also train each preset's plain twin (fp32 params, bf16 autocast) on the same batches",
    )
    p.add_argument(
        "--loss-variants",
        default="bf16,fp8_hybrid,fp8_hybrid_delayed",
        help="fp8_loss: FP8 runs beside bf16 (always run first): fp8_hybrid, fp8_hybrid_delayed",
    )
    return p


def main() -> None:
    p = build_parser()
    args = p.parse_args()
    if "engine_deterministic" in args.variants:  # cuBLAS reads it when its first handle is made
        os.environ.update(compute_deterministic_env(os.environ))
    unknown = set(args.loss_variants.split(",")) - set(LOSS_VARIANTS)
    if unknown:
        p.error(f"--loss-variants: unknown {sorted(unknown)}; known: {', '.join(LOSS_VARIANTS)}")
    global PRESET
    PRESET = args.preset
    torch.backends.cuda.matmul.allow_tf32 = True
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "args": vars(args)}
    benches = {
        "phases": bench_phases,
        "profile": bench_profile,
        "timeline": bench_timeline,
        "throughput": bench_throughput,
        "fp8_loss": bench_fp8_loss,
        "family_loss": bench_family_loss,
        "recompute": bench_recompute,
        "split": bench_split,
        "microbatch": bench_microbatch,
    }
    for name in args.only.split(","):
        benches[name](args, results)
        gc.collect()
        torch.cuda.empty_cache()
        print(json.dumps({name: results.get(name) or results.get("largest_micro_batch_eager")}, indent=1), flush=True)
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
