"""MegaScan tracing overhead, measured so that about 1% is resolved: paired rounds.

    python benchmarks/scan_overhead.py --preset small --rounds 40 --steps 10            # H200
    python benchmarks/scan_overhead.py --preset small --method alternating --pairs 150  # H200
    python benchmarks/scan_overhead.py --device cpu --preset tiny --rounds 6 --steps 3   # smoke

Why paired: a launch-bound model's step time drifts by +-20% between rounds a few seconds
apart (host clocks, other processes), far more than the 1-3% to resolve. So every round runs
the variants off / base / full back to back, in a fresh random order, on the same warmed
model, and the figure is the per-round ratio traced / off: drift slower than a round cancels.
Reported per variant: the median of the per-round ratios with a 95% bootstrap confidence
interval over rounds, with and without closing the tracer (close writes what the background
writer has not written yet; with rounds shorter than TraceConfig.flush_seconds that is the
whole trace, so "with close" is the cost including writing the trace).

--method alternating pairs adjacent steps instead of segments: per granularity, one step of
each adjacent pair is traced, the first or the second by a seeded coin (`pair_plan`), and the
traced step is divided by its untraced neighbour, ~0.1 s apart, so even drift within a round
cancels, and so does any bias of a pair's second step. A control pass traces neither step of its pairs and reports the same ratio: the
method's own bias, which should read 0 within its interval. This times the
training thread: after every step, outside the timing, the benchmark waits for the background
writer to finish what it was handed (`Tracer.wait_writer_idle`). Without that wait its work,
sliced to give the GIL back, spilled into the next steps, untraced or traced by the host's
pace, and moved the training-thread figure between hosts. The writer's own CPU time
(`Tracer.writer_cost`) is then added as if all of it had stalled training (the GIL), which
bounds the cost including writing the trace from above. That bound is given twice: with all of the writer's CPU time, and with its
steady-state time only (every batch after the first; the first also opens the file, which a
run of thousands of steps pays once, and a 150-pair measurement would charge to 150 steps).

Timing: torch.cuda.synchronize around every timed segment (on CUDA); Python's garbage
collector runs before and is disabled during each segment, so a collection triggered by
earlier rounds does not land in a random variant's time. Each traced segment makes a fresh
tracer (outside the timing: it stands for the tracer made once at the start of a run).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from megatronapp.engine.hooks import NULL_TRACER  # noqa: E402
from megatronapp.engine.trainer import Trainer  # noqa: E402
from megatronapp.files import write_text_atomic  # noqa: E402
from megatronapp.paired import bootstrap_median_ci, compute_position_effect, pair_plan, run_rounds, summarize_rounds  # noqa: E402
from megatronapp.parallel.groups import single_process_groups  # noqa: E402
from megatronapp.scan.record.format import build_rank_meta, load_rank_trace  # noqa: E402
from megatronapp.scan.record.tracer import TraceConfig, Tracer  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import FixedBatches, make_job, timed_seconds  # noqa: E402

VARIANTS = ("off", "base", "full")


def format_line(label: str, variant: str, summary: dict) -> str:
    """One line per variant, e.g. "small base: +0.41% [95% CI -0.20%, +1.02%] ..."."""
    s = summary[variant]
    w, wo = s["overhead_with_close"], s["overhead"]
    size = f", {s['bytes_per_event']:.1f} bytes/event" if "bytes_per_event" in s else ""
    return (
        f"{label} {variant}: {w['median']:+.2%} [95% CI {w['ci95'][0]:+.2%}, {w['ci95'][1]:+.2%}] with close, "
        f"{wo['median']:+.2%} [{wo['ci95'][0]:+.2%}, {wo['ci95'][1]:+.2%}] steps only; "
        f"median of {summary['rounds']} paired rounds x {summary['steps_per_round']} steps, "
        f"off {summary['off_step_ms']:.2f} ms/step{size}"
    )


# ----------------------------------------------------------------------------- measurement
def _new_tracer(granularity: str, trace_dir: str, device: torch.device) -> Tracer:
    meta = build_rank_meta(
        rank=0,
        world_size=1,
        coords={"tp": 0, "dp": 0, "pp": 0},
        layout={"tp_size": 1, "pp_size": 1, "dp_size": 1, "virtual_pp_size": 1},
        host="bench",
        device=str(device),
        run_id="overhead",
        clock="monotonic",
    )
    cfg = TraceConfig(enabled=True, trace_dir=trace_dir, interval=1, continuous_iterations=1, granularity=granularity)
    return Tracer(cfg, meta, device)


def measure_overhead(trainer: Trainer, device: torch.device, steps: int, rounds: int, seed: int = 0) -> dict:
    """Paired rounds of off / base / full on a warmed `trainer` (see the module docstring);
    returns summarize_rounds()'s dict plus bytes and events per step of the last traced segments."""
    sizes: dict[str, tuple[int, int]] = {}

    def measure(variant: str) -> dict[str, float]:
        if variant == "off":
            trainer.set_tracer(NULL_TRACER)
            return {"steps_s": timed_seconds(trainer.train_step, device, steps)}
        with tempfile.TemporaryDirectory(prefix=f"overhead-{variant}-") as d:
            tracer = _new_tracer(variant, d, device)
            trainer.set_tracer(tracer)
            trainer.iteration = max(trainer.iteration, 1)  # interval 1 traces from iteration 1 on
            steps_s = timed_seconds(trainer.train_step, device, steps)
            close_s = timed_seconds(tracer.close, device)
            trainer.set_tracer(NULL_TRACER)
            path = next(Path(d).glob("*.mscan"))
            sizes[variant] = (path.stat().st_size, load_rank_trace(path).events.num_rows)
        return {"steps_s": steps_s, "with_close_s": steps_s + close_s}

    results = run_rounds(measure, VARIANTS, rounds, seed)
    summary = summarize_rounds(results, steps, seed=seed)
    for variant, (size, rows) in sizes.items():
        summary[variant].update(bytes_per_event=size / max(rows, 1), events_per_step=rows / steps)
    summary["per_round"] = results
    return summary


def _pairs_tracer(granularity: str, trace_dir: str, device: torch.device, traced: set[int]) -> Tracer:
    """A tracer recording exactly the iterations in `traced` (every window flushed when due)."""
    tracer = _new_tracer(granularity, trace_dir, device)
    tracer.config = TraceConfig(
        enabled=True, trace_dir=trace_dir, interval=1, continuous_iterations=1, granularity=granularity
    )
    tracer.should_trace = traced.__contains__  # the plan's choice instead of the config's interval
    return tracer


def _one_pass(
    trainer: Trainer, device: torch.device, plan: list[tuple[int, int]], granularity: str, trace_dir: str, control: bool
) -> tuple[Tracer, list[tuple[float, float]], float]:
    """Run the plan's steps; (tracer, (treated, other) seconds per pair, close seconds).
    `control`: the treated step is not traced either (an A/A pass: the method's own bias)."""
    traced = set() if control else {t for t, _ in plan}
    tracer = _pairs_tracer(granularity, trace_dir, device, traced)
    trainer.set_tracer(tracer)
    times = {}
    while trainer.iteration < plan[0][0] and trainer.iteration < plan[0][1]:
        trainer.train_step()  # reach the plan's first iteration untraced
    for _ in range(2 * len(plan)):
        it = trainer.iteration
        times[it] = timed_seconds(trainer.train_step, device)
        tracer.wait_writer_idle()  # the writer's work (counted apart) out of every timed step
    close_s = timed_seconds(tracer.close, device)
    trainer.set_tracer(NULL_TRACER)
    return tracer, [(times[t], times[o]) for t, o in plan], close_s


def measure_alternating(trainer: Trainer, device: torch.device, pairs: int, seed: int = 0) -> dict:
    """Per granularity, and for an untraced control: `pairs` adjacent step pairs, one step of
    each traced (see the module docstring)."""
    out: dict = {"pairs": pairs}
    for variant in ("control", *VARIANTS[1:]):
        control = variant == "control"
        plan = pair_plan(pairs, trainer.iteration + 1, seed + len(out))
        with tempfile.TemporaryDirectory(prefix=f"overhead-{variant}-") as d:
            tracer, timed, close_s = _one_pass(trainer, device, plan, "base" if control else variant, d, control)
            path = next(Path(d).glob("*.mscan"), None)
            size = path.stat().st_size if path else 0
            rows = load_rank_trace(path).events.num_rows if path else 0
        ratios = [t / o for t, o in timed]
        first = [t_it < o_it for t_it, o_it in plan]  # the treated step came first in its pair
        median, lo, hi = bootstrap_median_ci(ratios, seed)
        entry = {
            "overhead": {
                "median": median - 1,
                "ci95": [lo - 1, hi - 1],
                "pair_range": [min(ratios) - 1, max(ratios) - 1],
            },
            "treated_first": sum(first),
            "close_s": close_s,
            "untraced_step_ms": statistics.median(o for _, o in timed) * 1e3,
            # per pair: treated s, other s, treated first? (to test a position bias afterwards)
            "pair_steps": [[t, o, f] for (t, o), f in zip(timed, first)],
        }
        if control:  # nothing differs within a pair but its position: the effect the coin cancels
            second = compute_position_effect(ratios, first)
            m2, lo2, hi2 = bootstrap_median_ci(second, seed)
            entry["position_effect"] = {"median": m2 - 1, "ci95": [lo2 - 1, hi2 - 1]}
            out[variant] = entry
            continue
        cost = tracer.writer_cost  # its first batch (opening the file) is paid once per run: apart
        traced_s = sum(t for t, _ in timed)
        writer, steady = cost.total_s / traced_s, cost.later_s / traced_s
        entry.update(
            {
                "writer_cpu_share": writer,
                "overhead_with_writer_bound": {
                    "median": median - 1 + writer,
                    "ci95": [lo - 1 + writer, hi - 1 + writer],
                },
                "writer_first_batch_s": cost.first_batch_s,
                "writer_steady_us_per_event": 1e6 * cost.later_s / max(cost.later_records, 1),
                "writer_steady_cpu_share": steady,
                "overhead_with_steady_writer_bound": {
                    "median": median - 1 + steady,
                    "ci95": [lo - 1 + steady, hi - 1 + steady],
                },
                "writer_batches": cost.batches,
                "traced_step_ms": traced_s / pairs * 1e3,
                "bytes_per_event": size / max(rows, 1),
                "events_per_traced_step": rows / pairs,
            }
        )
        out[variant] = entry
    return out


def format_alternating(label: str, variant: str, out: dict) -> str:
    v = out[variant]
    if variant == "control":
        o = v["overhead"]
        pe = v["position_effect"]
        return (
            f"{label} control (neither step traced): {o['median']:+.2%} [95% CI {o['ci95'][0]:+.2%}, "
            f"{o['ci95'][1]:+.2%}], the method's own bias; a pair's second step vs its first "
            f"{pe['median']:+.2%} [{pe['ci95'][0]:+.2%}, {pe['ci95'][1]:+.2%}], what a fixed order would charge; "
            f"untraced {v['untraced_step_ms']:.2f} ms/step"
        )
    o, w, ws = v["overhead"], v["overhead_with_writer_bound"], v["overhead_with_steady_writer_bound"]
    return (
        f"{label} {variant}: {o['median']:+.2%} [95% CI {o['ci95'][0]:+.2%}, {o['ci95'][1]:+.2%}] training thread, "
        f"<= {w['median']:+.2%} [{w['ci95'][0]:+.2%}, {w['ci95'][1]:+.2%}] with the writer's CPU time "
        f"(first batch {v['writer_first_batch_s'] * 1e3:.1f} ms), "
        f"<= {ws['median']:+.2%} [{ws['ci95'][0]:+.2%}, {ws['ci95'][1]:+.2%}] with its steady-state time "
        f"({v['writer_steady_us_per_event']:.1f} us/event); "
        f"median of {out['pairs']} adjacent step pairs (traced first in {v['treated_first']}), untraced {v['untraced_step_ms']:.2f} ms/step, "
        f"{v['bytes_per_event']:.1f} bytes/event"
    )


def bench(
    preset: str,
    micro_batch: int,
    num_micro: int,
    device: torch.device,
    steps: int,
    rounds: int,
    warmup: int,
    compile_model: bool,
    seed: int = 0,
    pairs: int | None = None,
) -> dict:
    """Build and warm the model, then measure_overhead (or, given `pairs`, measure_alternating)."""
    on_cuda = device.type == "cuda"  # bf16 (Megatron-style) on CUDA, fp32 on the CPU
    job = make_job(
        preset,
        micro_batch,
        num_micro,
        model_overrides={"vocab_size": 50304 if on_cuda else 1024},
        bf16=on_cuda,
        compile=compile_model,
    )
    trainer = Trainer(job, single_process_groups(), device, FixedBatches(job, device))
    for _ in range(warmup):
        trainer.train_step()
    if pairs is not None:
        return measure_alternating(trainer, device, pairs, seed)
    return measure_overhead(trainer, device, steps, rounds, seed)


def add_job_args(p: argparse.ArgumentParser, rounds: int, warmup: int) -> None:
    """The model and round arguments."""
    p.add_argument("--preset", default="small")
    p.add_argument("--device", default="cuda")
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--num-micro", type=int, default=2)
    p.add_argument("--steps", type=int, default=10, help="steps per variant per round")
    p.add_argument("--rounds", type=int, default=rounds)
    p.add_argument("--warmup", type=int, default=warmup)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_job_args(p, rounds=40, warmup=5)
    p.add_argument("--no-compile", action="store_true", help="eager model (default: compiled on CUDA)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--method", choices=("segments", "alternating"), default="segments")
    p.add_argument("--pairs", type=int, default=150, help="--method alternating: step pairs per granularity")
    p.add_argument("--out", default=None, help="write the summary (and every round) as JSON here")
    return p


def main() -> None:
    p = build_parser()
    args = p.parse_args()
    if args.steps < 1 or args.rounds < 2 or args.pairs < 2:
        p.error("--steps must be >= 1, --rounds >= 2 and --pairs >= 2")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("CUDA is not available: use --device cpu for a smoke run")
    began = time.perf_counter()
    alternating = args.method == "alternating"
    summary = bench(
        args.preset,
        args.micro_batch,
        args.num_micro,
        device,
        args.steps,
        args.rounds,
        args.warmup,
        device.type == "cuda" and not args.no_compile,
        args.seed,
        args.pairs if alternating else None,
    )
    for variant in (("control",) if alternating else ()) + VARIANTS[1:]:
        print((format_alternating if alternating else format_line)(args.preset, variant, summary), flush=True)
    print(f"({time.perf_counter() - began:.0f} s)")
    if args.out:
        write_text_atomic(args.out, json.dumps({"args": vars(args), **summary}, indent=1))


if __name__ == "__main__":
    main()
