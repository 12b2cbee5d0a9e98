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

from megatronapp.dpp.config import DPP_FLAGS, DppConfig, JitterSpec, parse_jitter
from megatronapp.dpp.scheduler import check_cap, compute_default_caps
from megatronapp.dpp.sim.simulator import CostModel, SimResult, simulate
from megatronapp.dpp.sim.static_agents import STATIC_COMM_MODELS
from megatronapp.flags import Flag, add_flags, read_flags
from megatronapp.parallel.layout import ParallelLayout
from megatronapp.pipeline.schedules import SCHEDULE_NAMES, build_schedule


@dataclasses.dataclass(frozen=True)
class ScheduleRun:
    """What `schedule simulate|show` will simulate or draw, from its flags; the defaults here are
    the flags' (cli/validate.py checks it, `run_simulate` and `run_show` read only it)."""

    pp: int = 4  # pipeline ranks of the simulated pipeline
    vpp: int = 2  # model chunks per pipeline rank
    microbatches: int = 8
    schedule: str | None = None  # None: dynamic, or the traced run's schedule with --from-trace
    dpp: DppConfig = dataclasses.field(default_factory=DppConfig)
    split_backward: bool = True  # dynamic: W tasks fill the waits, as training
    weight_grad_share: float = 0.5
    forward_ms: str = "1"  # per task; one value or one per pipeline rank
    backward_ms: str = "2"
    p2p_latency_ms: float | None = None  # None: 0, or with --from-trace the delay measured there
    p2p_bandwidth_gbps: float = 0.0  # 0: infinite
    message_bytes: int = 0
    decision_us: float = 0.0
    static_comm: str | None = None  # None: rendezvous, or eager with --from-trace
    jitter: tuple[JitterSpec, ...] = ()  # --inject-jitter, parsed (global ranks)
    from_trace: str | None = None
    as_json: bool = False  # simulate --json
    out: str = "schedule.png"  # show: the Gantt chart
    chrome: str | None = None  # show: also a Chrome trace JSON
    iteration: int | None = None  # show --from-trace: which iteration (None: the last traced)
    simulate: bool = False  # show --from-trace: draw the simulation, not the record


SCHEDULE_FLAGS = (
    Flag(
        "--pipeline-model-parallel-size",
        "pp",
        "pipeline ranks of the simulated pipeline",
        {"type": int, "metavar": "PP"},
    ),
    Flag("--num-microbatches", "microbatches", "microbatches per iteration", {"metavar": "MICROBATCHES"}),
    Flag("--num-layers", None, "the model's layers, for --num-layers-per-virtual-pipeline-stage", {"type": int}),
    Flag(
        "--pipeline-schedule",
        "schedule",
        "default: dynamic, or the traced run's schedule with --from-trace",
        {"choices": (*SCHEDULE_NAMES, "dynamic")},
    ),
    Flag(
        "--no-split-backward",
        "split_backward",
        "dynamic: whole backward tasks, no W filling (default: split, as training)",
        {"action": "store_false"},
    ),
    Flag(
        "--weight-grad-share", "weight_grad_share", "share of a backward's time that is W when split (I gets the rest)"
    ),
    Flag("--forward-ms", "forward_ms", "per task; one value or one per pipeline rank"),
    Flag("--backward-ms", "backward_ms", "per task; one value or one per pipeline rank"),
    Flag(
        "--p2p-latency-ms",
        "p2p_latency_ms",
        "default 0, or with --from-trace the delay measured in the trace",
        {"type": float},
    ),
    Flag("--p2p-bandwidth-gbps", "p2p_bandwidth_gbps", "0: infinite"),
    Flag("--message-bytes", "message_bytes"),
    Flag("--decision-us", "decision_us", "cost of each dynamic decision"),
    Flag(
        "--static-comm",
        "static_comm",
        "how a static schedule's messages move: rendezvous = the static runtime on gloo "
        "(batches waited whole, a send moves once its recv is posted); eager = every recv "
        "posted ahead (dpp/sim/static_agents.py). Default: rendezvous, or eager with --from-trace "
        "(the overhead fitted from a trace already holds the rendezvous waits)",
        {"choices": STATIC_COMM_MODELS},
    ),
    Flag("--from-trace", "from_trace", "task times (and layout) of a MegaScan trace", {"metavar": "DIR"}),
)
SIMULATE_FLAGS = (Flag("--json", "as_json", "print one JSON object", {"action": "store_true"}),)
SHOW_FLAGS = (
    Flag("--out", "out", "Gantt chart PNG to write", aliases=("-o",)),
    Flag("--chrome", "chrome", "also write a Chrome trace JSON here"),
    Flag(
        "--iteration",
        "iteration",
        "with --from-trace: which iteration to draw (default: the last traced)",
        {"type": int},
    ),
    Flag("--simulate", "simulate", "with --from-trace: draw the simulation, not the record", {"action": "store_true"}),
)


# Megatron's two spellings of the virtual stage count; one of them at most
VIRTUAL_STAGE_FLAGS = (
    Flag(
        "--num-virtual-stages-per-pipeline-rank",
        "vpp",
        f"model chunks per pipeline rank (default: {ScheduleRun.vpp})",
        {"metavar": "VPP", "type": int},
    ),
    Flag(
        "--num-layers-per-virtual-pipeline-stage",
        None,
        "layers per model chunk, with --num-layers: chunks = layers / (PP x this)",
        {"type": int},
    ),
)


def compute_virtual_stages(vpp: int | None, pp: int, layers_per_stage: int | None, num_layers: int | None) -> int:
    """Model chunks per pipeline rank: `vpp` (None: ScheduleRun's default), or as Megatron derives it
    from --num-layers-per-virtual-pipeline-stage, num layers / (PP x layers per stage); ValueError (one line)."""
    if layers_per_stage is None:
        return ScheduleRun.vpp if vpp is None else vpp
    if num_layers is None:
        raise ValueError("--num-layers-per-virtual-pipeline-stage needs --num-layers (the simulator has no model)")
    if min(layers_per_stage, num_layers, pp) < 1:
        return 0  # check_schedule_run names the value below 1
    if num_layers % (pp * layers_per_stage):
        raise ValueError(
            f"num layers {num_layers} is not divisible by pipeline-parallel size {pp} "
            f"x layers per virtual stage {layers_per_stage}"
        )
    return num_layers // (pp * layers_per_stage)


def _add_schedule_command(leaf, name: str, help: str, own_flags, launch) -> None:
    p = leaf.add_parser(name, help=help)
    add_flags(p, SCHEDULE_FLAGS, ScheduleRun)
    # no config defaults here: argparse tells the two apart only when neither has a default
    add_flags(p.add_mutually_exclusive_group(), VIRTUAL_STAGE_FLAGS)
    add_flags(p, DPP_FLAGS[:2], DppConfig)  # --dpp-traversal, --dpp-max-inflight
    add_flags(p, own_flags, ScheduleRun)

    def build_run(args: argparse.Namespace) -> ScheduleRun:
        dpp = DppConfig(**read_flags(args, DPP_FLAGS[:2]))
        fields = read_flags(args, SCHEDULE_FLAGS + VIRTUAL_STAGE_FLAGS + own_flags)
        per, layers = args.num_layers_per_virtual_pipeline_stage, args.num_layers
        fields["vpp"] = compute_virtual_stages(fields["vpp"], fields["pp"], per, layers)
        jitter = tuple(parse_jitter(spec) for spec in args.inject_jitter or ())
        return ScheduleRun(**fields, dpp=dpp, jitter=jitter)

    p.set_defaults(build_run=build_run, launch=lambda run, argv: launch(run))


def add_schedule_subcommands(sub) -> None:
    parser = sub.add_parser("schedule", help="simulate or draw pipeline schedules (MegaDPP)")
    leaf = parser.add_subparsers(dest="schedule_command", required=True)
    _add_schedule_command(
        leaf, "simulate", "iteration time, bubble fraction, peak in-flight per rank", SIMULATE_FLAGS, run_simulate
    )
    _add_schedule_command(
        leaf, "show", "Gantt chart (PNG) and Chrome/Perfetto trace of a schedule", SHOW_FLAGS, run_show
    )


def _per_rank(text: str, pp: int, flag: str) -> tuple[float, ...]:
    try:
        values = [float(x) / 1e3 for x in text.split(",")]
    except ValueError:
        raise ValueError(f"{flag} expects numbers, got {text!r}") from None
    if len(values) not in (1, pp) or min(values) < 0:
        raise ValueError(f"{flag} needs 1 or {pp} non-negative values, got {text!r}")
    return tuple(values * pp if len(values) == 1 else values)


def _link(run: ScheduleRun, latency_ms: float = 0.0) -> dict:
    if run.p2p_latency_ms is not None:
        latency_ms = run.p2p_latency_ms
    return dict(
        p2p_latency_s=latency_ms / 1e3,
        p2p_bandwidth_Bps=run.p2p_bandwidth_gbps * 1e9 / 8 if run.p2p_bandwidth_gbps else float("inf"),
        message_bytes=run.message_bytes,
        decision_s=run.decision_us / 1e6,
    )


def compute_pipeline_jitter(
    specs: tuple[JitterSpec, ...], tp_size: int, dp_size: int, pp_size: int
) -> tuple[JitterSpec, ...]:
    """--inject-jitter specs (global ranks of a TP x DP x PP job) as specs on the pipeline ranks of
    the simulated pipeline, the one of tp 0, dp 0; a rank elsewhere is refused in one line."""
    layout = ParallelLayout(tp_size * dp_size * pp_size, tp_size, pp_size)
    on_pipeline = [layout.rank_of(0, 0, p) for p in range(pp_size)]
    out = []
    for spec in specs:
        if spec.rank not in on_pipeline:
            raise ValueError(
                f"--inject-jitter rank {spec.rank} is not on the simulated pipeline "
                f"(global ranks {', '.join(map(str, on_pipeline))})"
            )
        out.append(dataclasses.replace(spec, rank=layout.coords(spec.rank).pp))
    return tuple(out)


def build_setup(run: ScheduleRun) -> tuple[int, int, int, str, CostModel, object]:
    """(P, V, M, schedule name, cost model, traced run or None) of the validated `run`."""
    if run.from_trace:
        from megatronapp.dpp.sim import trace_costs

        traced = trace_costs.load_traced_run(run.from_trace)
        pp, vpp, m = traced.pp_size, traced.num_chunks, traced.num_microbatches
        link = _link(run, trace_costs.estimate_p2p_latency_s(traced) * 1e3)
        link["jitter"] = compute_pipeline_jitter(run.jitter, traced.tp_size, traced.dp_size, pp)
        link["task_overhead_s"] = trace_costs.estimate_task_overheads_s(traced, link["p2p_latency_s"])
        name = run.schedule or traced.schedule
        return pp, vpp, m, name, trace_costs.compute_trace_costs(traced, **link), traced
    pp, vpp, m = run.pp, run.vpp, run.microbatches
    fwd, bwd = _per_rank(run.forward_ms, pp, "--forward-ms"), _per_rank(run.backward_ms, pp, "--backward-ms")
    cost = CostModel(
        tuple((f,) * vpp for f in fwd),
        tuple((b,) * vpp for b in bwd),
        **_link(run),
        weight_grad_share=run.weight_grad_share,
        jitter=compute_pipeline_jitter(run.jitter, 1, 1, pp),
    )
    return pp, vpp, m, run.schedule or "dynamic", cost, None


def check_schedule_run(run: ScheduleRun) -> None:
    """Costs and link values, and without a trace the pipeline's shape, its costs per rank, jitter
    on its ranks and a dynamic cap it can run with; ValueError (one line)."""
    if (run.p2p_latency_ms or 0.0) < 0 or min(run.p2p_bandwidth_gbps, run.message_bytes, run.decision_us) < 0:
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
    compute_pipeline_jitter(run.jitter, 1, 1, pp)
    if (run.schedule or "dynamic") == "dynamic" and run.dpp.max_inflight is not None:
        check_cap(run.dpp.max_inflight, vpp)


def simulate_run(run: ScheduleRun) -> tuple[SimResult, str, list[int] | None, object]:
    """(result, schedule label, per-rank caps for dynamic, traced run or None) of the validated `run`."""
    pp, vpp, m, name, cost, traced = build_setup(run)
    if name != "dynamic":
        schedule = build_schedule(name, pp, vpp, m)
        comm = run.static_comm or ("eager" if traced is not None else "rendezvous")
        return simulate(pp, vpp, m, cost, schedule=schedule, static_comm=comm), name, None, traced
    cap = run.dpp.max_inflight
    caps = [cap] * pp if cap else compute_default_caps(pp, vpp, m)
    if traced is not None:  # the traced shape was not known when the run was checked
        check_cap(caps[0], vpp)
    traversal = run.dpp.traversal
    res = simulate(pp, vpp, m, cost, traversal=traversal, caps=caps, split_backward=run.split_backward)
    return res, f"dynamic/{traversal}" + ("+W" if run.split_backward else ""), caps, traced


def run_simulate(run: ScheduleRun) -> int:
    try:
        res, name, caps, traced = simulate_run(run)
    except (ValueError, FileNotFoundError) as exc:  # a trace folder that does not hold a readable run
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
    if traced is not None:  # how far the prediction is from what the trace recorded
        from megatronapp.dpp.sim.trace_costs import compute_iteration_times

        measured = statistics.fmean(compute_iteration_times(traced).values())
        report.update(measured_iteration_s=measured, prediction_error=res.makespan_s / measured - 1.0)
    if run.as_json:
        print(json.dumps(report))
        return 0
    print(f"{name}: iteration {res.makespan_s * 1e3:.3f} ms, bubble {res.bubble_fraction:.1%}")
    if traced is not None:
        print(
            f"  traced run: mean {report['measured_iteration_s'] * 1e3:.3f} ms per iteration "
            f"(forward/backward window); prediction {report['prediction_error']:+.1%}"
        )
    for r, (act, mb) in enumerate(zip(res.peak_activations, res.peak_inflight)):
        cap = f" (cap {caps[r]})" if caps else ""
        print(f"  pp rank {r}: peak in-flight {act} activation sets{cap}, {mb} microbatches")
    return 0


def run_show(run: ScheduleRun) -> int:
    from megatronapp.dpp.sim.render import save_chrome_trace, save_gantt_png

    try:
        if run.from_trace and not run.simulate:
            _, _, _, name, _, traced = build_setup(run)
            it = run.iteration if run.iteration is not None else max(traced.spans)
            if it not in traced.spans:
                raise ValueError(f"iteration {it} is not in the trace (have {sorted(traced.spans)})")
            spans, title = traced.spans[it], f"{run.from_trace}: {name}, iteration {it} (recorded)"
        else:
            res, name, _, _ = simulate_run(run)
            spans = res.spans
            title = f"{name} (simulated): {res.makespan_s * 1e3:.3f} ms, bubble {res.bubble_fraction:.1%}"
        save_gantt_png(spans, run.out, title)
        if run.chrome:
            save_chrome_trace(spans, run.chrome, title)
    except (ValueError, FileNotFoundError, OSError) as exc:
        print(f"megatronapp: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {run.out}" + (f" and {run.chrome}" if run.chrome else ""))
    return 0
