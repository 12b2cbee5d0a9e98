"""`megatronapp schedule simulate|show`: run any schedule against a cost model, or draw one.

    megatronapp schedule simulate --pipeline-model-parallel-size 4 --num-virtual-stages-per-pipeline-rank 2 \
        --num-microbatches 8 --pipeline-schedule dynamic --dpp-traversal adaptive \
        --forward-ms 10 --backward-ms 20 --p2p-latency-ms 0.5 --inject-jitter 2:1.5:7
    megatronapp schedule simulate --from-trace runs/t --pipeline-schedule interleaved   # task times of a real run
    megatronapp schedule show --pipeline-model-parallel-size 4 --num-virtual-stages-per-pipeline-rank 2 \
        --num-microbatches 8 --pipeline-schedule interleaved --out s.png --chrome s.json
    megatronapp schedule show --from-trace runs/t --out real.png                   # the recorded timeline

Flags are `train`'s (Megatron's) names. Costs: --forward-ms / --backward-ms take one value or one
per pipeline rank (comma-separated). --inject-jitter RANK:MAXFACTOR[:SEED] names a global rank, as
in `train`: without a trace the simulated job is one pipeline (global rank = pipeline rank); with
--from-trace the traced layout maps it, and it must be on the simulated pipeline (tp 0, dp 0).
Bad input: one line on stderr, exit code 2, before anything runs (cli/validate.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys

from megatronapp.dpp.config import DppConfig, JitterSpec, parse_jitter
from megatronapp.dpp.policies import TRAVERSALS
from megatronapp.dpp.scheduler import check_cap, compute_default_caps
from megatronapp.dpp.sim.simulator import CostModel, SimResult, simulate
from megatronapp.dpp.sim.static_agents import STATIC_COMM_MODELS
from megatronapp.parallel.layout import ParallelLayout
from megatronapp.pipeline.schedules import SCHEDULE_NAMES, build_schedule

DEFAULT_VIRTUAL_STAGES = 2


def compute_virtual_stages(args) -> int:
    """Model chunks per pipeline rank: --num-virtual-stages-per-pipeline-rank, or as Megatron
    derives it, --num-layers / (PP x --num-layers-per-virtual-pipeline-stage); ValueError (one line)."""
    per, layers, pp = args.layers_per_virtual_stage, args.num_layers, args.pp
    if per is None:
        return DEFAULT_VIRTUAL_STAGES if args.vpp is None else args.vpp
    if layers is None:
        raise ValueError("--num-layers-per-virtual-pipeline-stage needs --num-layers (the simulator has no model)")
    if min(per, layers, pp) < 1:
        return 0  # check_schedule_run names the value below 1
    if layers % (pp * per):
        raise ValueError(
            f"num layers {layers} is not divisible by pipeline-parallel size {pp} x layers per virtual stage {per}"
        )
    return layers // (pp * per)


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pipeline-model-parallel-size", type=int, default=4, dest="pp", help="pipeline stages")
    vpp = p.add_mutually_exclusive_group()  # Megatron's two spellings of the virtual stage count
    vpp.add_argument(
        "--num-virtual-stages-per-pipeline-rank",
        type=int,
        default=None,
        dest="vpp",
        help=f"model chunks per pipeline rank (default: {DEFAULT_VIRTUAL_STAGES})",
    )
    vpp.add_argument(
        "--num-layers-per-virtual-pipeline-stage",
        type=int,
        default=None,
        dest="layers_per_virtual_stage",
        help="layers per model chunk, with --num-layers: chunks = layers / (PP x this)",
    )
    p.add_argument(
        "--num-layers", type=int, default=None, help="the model's layers, for --num-layers-per-virtual-pipeline-stage"
    )
    p.add_argument("--num-microbatches", type=int, default=8, dest="microbatches", help="microbatches per iteration")
    p.add_argument(
        "--pipeline-schedule",
        choices=(*SCHEDULE_NAMES, "dynamic"),
        default=None,
        dest="schedule",
        help="default: dynamic, or the traced run's schedule with --from-trace",
    )
    p.add_argument(
        "--dpp-traversal", choices=TRAVERSALS, default=DppConfig.traversal, help="dynamic: the order ready tasks run in"
    )
    p.add_argument(
        "--no-split-backward",
        dest="split_backward",
        action="store_false",
        help="dynamic: whole backward tasks, no W filling (default: split, as training)",
    )
    p.add_argument(
        "--weight-grad-share",
        type=float,
        default=0.5,
        help="share of a backward's time that is W when split (I gets the rest)",
    )
    p.add_argument(
        "--dpp-max-inflight",
        type=int,
        default=None,
        help="dynamic: activation sets a rank may hold (default: what interleaved 1F1B holds)",
    )
    p.add_argument("--forward-ms", default="1", help="per task; one value or one per pipeline rank")
    p.add_argument("--backward-ms", default="2", help="per task; one value or one per pipeline rank")
    p.add_argument(
        "--p2p-latency-ms",
        type=float,
        default=None,
        help="default 0, or with --from-trace the delay measured in the trace",
    )
    p.add_argument("--p2p-bandwidth-gbps", type=float, default=0.0, help="0: infinite")
    p.add_argument("--message-bytes", type=int, default=0, help="bytes per activation message (with the bandwidth)")
    p.add_argument("--decision-us", type=float, default=0.0, help="cost of each dynamic decision")
    p.add_argument(
        "--static-comm",
        choices=STATIC_COMM_MODELS,
        default=None,
        help="how a static schedule's messages move: rendezvous = the static runtime on gloo "
        "(batches waited whole, a send moves once its recv is posted); eager = every recv "
        "posted ahead (dpp/sim/static_agents.py). Default: rendezvous, or eager with --from-trace "
        "(the overhead fitted from a trace already holds the rendezvous waits)",
    )
    p.add_argument(
        "--inject-jitter",
        action="append",
        default=[],
        metavar="RANK:MAXFACTOR[:SEED]",
        help="global rank, as in train (see the module docstring)",
    )
    p.add_argument("--from-trace", default=None, metavar="DIR", help="task times (and layout) of a MegaScan trace")


def add_schedule_subcommands(sub) -> None:
    parser = sub.add_parser("schedule", help="simulate or draw pipeline schedules (MegaDPP)")
    leaf = parser.add_subparsers(dest="schedule_command", required=True)
    sim = leaf.add_parser("simulate", help="iteration time, bubble fraction, peak in-flight per rank")
    _add_common(sim)
    sim.add_argument("--json", action="store_true", help="print the result as one JSON object")
    sim.set_defaults(build_run=build_schedule_run, launch=lambda args, argv, run: run_simulate(args))
    show = leaf.add_parser("show", help="Gantt chart (PNG) and Chrome/Perfetto trace of a schedule")
    _add_common(show)
    show.add_argument("-o", "--out", default="schedule.png", help="Gantt chart PNG to write")
    show.add_argument("--chrome", default=None, help="also write a Chrome trace JSON here")
    show.add_argument(
        "--iteration",
        type=int,
        default=None,
        help="with --from-trace: which iteration to draw (default: the last traced)",
    )
    show.add_argument("--simulate", action="store_true", help="with --from-trace: draw the simulation, not the record")
    show.set_defaults(build_run=build_schedule_run, launch=lambda args, argv, run: run_show(args))


def _per_rank(text: str, pp: int, flag: str) -> tuple[float, ...]:
    try:
        values = [float(x) / 1e3 for x in text.split(",")]
    except ValueError:
        raise ValueError(f"{flag} expects numbers, got {text!r}") from None
    if len(values) not in (1, pp) or min(values) < 0:
        raise ValueError(f"{flag} needs 1 or {pp} non-negative values, got {text!r}")
    return tuple(values * pp if len(values) == 1 else values)


def _link(args, latency_ms: float = 0.0) -> dict:
    if args.p2p_latency_ms is not None:
        latency_ms = args.p2p_latency_ms
    if latency_ms < 0 or args.p2p_bandwidth_gbps < 0 or args.message_bytes < 0 or args.decision_us < 0:
        raise ValueError("latency, bandwidth, message bytes and decision cost must be >= 0")
    return dict(
        p2p_latency_s=latency_ms / 1e3,
        p2p_bandwidth_Bps=args.p2p_bandwidth_gbps * 1e9 / 8 if args.p2p_bandwidth_gbps else float("inf"),
        message_bytes=args.message_bytes,
        decision_s=args.decision_us / 1e6,
    )


def compute_pipeline_jitter(specs: list[str], tp_size: int, dp_size: int, pp_size: int) -> tuple[JitterSpec, ...]:
    """--inject-jitter specs (global ranks of a TP x DP x PP job) as specs on the pipeline ranks of
    the simulated pipeline, the one of tp 0, dp 0; a rank elsewhere is refused in one line."""
    layout = ParallelLayout(tp_size * dp_size * pp_size, tp_size, pp_size)
    on_pipeline = [layout.rank_of(0, 0, p) for p in range(pp_size)]
    out = []
    for spec in map(parse_jitter, specs):
        if spec.rank not in on_pipeline:
            raise ValueError(
                f"--inject-jitter rank {spec.rank} is not on the simulated pipeline "
                f"(global ranks {', '.join(map(str, on_pipeline))})"
            )
        out.append(dataclasses.replace(spec, rank=layout.coords(spec.rank).pp))
    return tuple(out)


def build_setup(args) -> tuple[int, int, int, str, CostModel, object]:
    """(P, V, M, schedule name, cost model, traced run or None) from the flags."""
    if args.from_trace:
        from megatronapp.dpp.sim import trace_costs

        run = trace_costs.load_traced_run(args.from_trace)
        pp, vpp, m = run.pp_size, run.num_chunks, run.num_microbatches
        link = _link(args, trace_costs.estimate_p2p_latency_s(run) * 1e3)
        link["jitter"] = compute_pipeline_jitter(args.inject_jitter, run.tp_size, run.dp_size, pp)
        link["task_overhead_s"] = trace_costs.estimate_task_overheads_s(run, link["p2p_latency_s"])
        return pp, vpp, m, args.schedule or run.schedule, trace_costs.compute_trace_costs(run, **link), run
    pp, vpp, m = args.pp, compute_virtual_stages(args), args.microbatches
    fwd, bwd = _per_rank(args.forward_ms, pp, "--forward-ms"), _per_rank(args.backward_ms, pp, "--backward-ms")
    cost = CostModel(
        tuple((f,) * vpp for f in fwd),
        tuple((b,) * vpp for b in bwd),
        **_link(args),
        weight_grad_share=args.weight_grad_share,
        jitter=compute_pipeline_jitter(args.inject_jitter, 1, 1, pp),
    )
    return pp, vpp, m, args.schedule or "dynamic", cost, None


@dataclasses.dataclass(frozen=True)
class ScheduleRun:
    """The flags of `schedule simulate|show` that its checks read (cli/validate.py runs them)."""

    pp: int
    vpp: int
    microbatches: int
    schedule: str | None
    dpp: DppConfig
    weight_grad_share: float
    forward_ms: str
    backward_ms: str
    # latency ms (None: the default), bandwidth Gbps, message bytes, decision us
    link: tuple[float | None, float, int, float]
    jitter: tuple[str, ...]
    from_trace: str | None


def build_schedule_run(args) -> ScheduleRun:
    return ScheduleRun(
        args.pp,
        compute_virtual_stages(args),
        args.microbatches,
        args.schedule,
        DppConfig(args.dpp_traversal, args.dpp_max_inflight),
        args.weight_grad_share,
        args.forward_ms,
        args.backward_ms,
        (args.p2p_latency_ms, args.p2p_bandwidth_gbps, args.message_bytes, args.decision_us),
        tuple(args.inject_jitter),
        args.from_trace,
    )


def check_schedule_run(run: ScheduleRun) -> None:
    """Costs and link values, and without a trace the pipeline's shape, its costs per rank, jitter
    on its ranks and a dynamic cap it can run with; ValueError (one line)."""
    latency, bandwidth, message_bytes, decision = run.link
    if (latency or 0.0) < 0 or bandwidth < 0 or message_bytes < 0 or decision < 0:
        raise ValueError("latency, bandwidth, message bytes and decision cost must be >= 0")
    if not 0.0 < run.weight_grad_share < 1.0:
        raise ValueError(f"--weight-grad-share must be in (0, 1), got {run.weight_grad_share}")
    if run.from_trace is not None:
        if not os.path.isdir(run.from_trace):
            raise ValueError(f"--from-trace {run.from_trace} is not a folder")
        return  # the traced run gives the shape and the costs
    pp, vpp, m = run.pp, run.vpp, run.microbatches
    if min(pp, vpp, m) < 1:
        raise ValueError(f"pipeline size, virtual stages and microbatches must be >= 1, got {pp}, {vpp}, {m}")
    _per_rank(run.forward_ms, pp, "--forward-ms")
    _per_rank(run.backward_ms, pp, "--backward-ms")
    compute_pipeline_jitter(list(run.jitter), 1, 1, pp)
    if (run.schedule or "dynamic") == "dynamic" and run.dpp.max_inflight is not None:
        check_cap(run.dpp.max_inflight, vpp)


def simulate_from_args(args) -> tuple[SimResult, str, list[int] | None, object]:
    """(result, schedule label, per-rank caps for dynamic, traced run or None)."""
    pp, vpp, m, name, cost, run = build_setup(args)
    if name != "dynamic":
        schedule = build_schedule(name, pp, vpp, m)
        comm = args.static_comm or ("eager" if run is not None else "rendezvous")
        return simulate(pp, vpp, m, cost, schedule=schedule, static_comm=comm), name, None, run
    DppConfig(args.dpp_traversal, args.dpp_max_inflight)
    caps = [args.dpp_max_inflight] * pp if args.dpp_max_inflight else compute_default_caps(pp, vpp, m)
    check_cap(caps[0], vpp)
    res = simulate(pp, vpp, m, cost, traversal=args.dpp_traversal, caps=caps, split_backward=args.split_backward)
    return res, f"dynamic/{args.dpp_traversal}" + ("+W" if args.split_backward else ""), caps, run


def run_simulate(args) -> int:
    try:
        res, name, caps, run = simulate_from_args(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"megatronapp: error: {exc}", file=sys.stderr)
        return 2
    report = {
        "schedule": name,
        "iteration_s": res.makespan_s,
        "bubble_fraction": res.bubble_fraction,
        "peak_inflight_activations": res.peak_activations,
        "peak_inflight_microbatches": res.peak_inflight,
        "caps": caps,
    }
    if run is not None:  # how far the prediction is from what the trace recorded
        from megatronapp.dpp.sim.trace_costs import compute_iteration_times

        measured = statistics.fmean(compute_iteration_times(run).values())
        report.update(measured_iteration_s=measured, prediction_error=res.makespan_s / measured - 1.0)
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"{name}: iteration {res.makespan_s * 1e3:.3f} ms, bubble {res.bubble_fraction:.1%}")
    if run is not None:
        print(
            f"  traced run: mean {report['measured_iteration_s'] * 1e3:.3f} ms per iteration "
            f"(forward/backward window); prediction {report['prediction_error']:+.1%}"
        )
    for r, (act, mb) in enumerate(zip(res.peak_activations, res.peak_inflight)):
        cap = f" (cap {caps[r]})" if caps else ""
        print(f"  pp rank {r}: peak in-flight {act} activation sets{cap}, {mb} microbatches")
    return 0


def run_show(args) -> int:
    from megatronapp.dpp.sim.render import save_chrome_trace, save_gantt_png

    try:
        if args.from_trace and not args.simulate:
            _, _, _, name, _, run = build_setup(args)
            it = args.iteration if args.iteration is not None else max(run.spans)
            if it not in run.spans:
                raise ValueError(f"iteration {it} is not in the trace (have {sorted(run.spans)})")
            spans, title = run.spans[it], f"{args.from_trace}: {name}, iteration {it} (recorded)"
        else:
            res, name, _, _ = simulate_from_args(args)
            spans = res.spans
            title = f"{name} (simulated): {res.makespan_s * 1e3:.3f} ms, bubble {res.bubble_fraction:.1%}"
        save_gantt_png(spans, args.out, title)
        if args.chrome:
            save_chrome_trace(spans, args.chrome, title)
    except (ValueError, FileNotFoundError, OSError) as exc:
        print(f"megatronapp: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}" + (f" and {args.chrome}" if args.chrome else ""))
    return 0
