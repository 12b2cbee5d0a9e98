"""What-if studies on the MegaDPP simulator, pure and fast (no processes).

Per pipeline (PP, V, M) and scenario (`scenarios.py`), over jitter seeds: static interleaved
1F1B and static breadth-first, each under both comm models (`static_agents.py`: "eager" = a
static order whose receives are all posted ahead; "rendezvous" = what the static runtime does
on gloo, batches waited whole and sends that move only once the receiver posted), and the
dynamic traversals at interleaved's per-rank cap. The reference is interleaved/rendezvous (the
static runtime). Per variant: mean seconds per iteration, speed vs the reference (ratio of
means) and the spread of per-seed ratios; two lower bounds per seed (`bounds.py`):
`bound` (clairvoyant: the seed's largest jitter factors on the shortest tasks) and `online`
(tasks at the mean factor: what a policy that cannot see a factor before running the task can
at best average).

Also the costs of a simulated step that a traced one-GPU run feeds in: the P2P message of one
microbatch, a link model (latency + bytes / bandwidth) and the activation memory held per rank.
"""

from __future__ import annotations

import statistics
from dataclasses import replace

from megatronapp.dpp.scheduler import compute_default_caps
from megatronapp.dpp.sim.bounds import compute_step_bound_s
from megatronapp.dpp.sim.scenarios import compute_scenario_sim
from megatronapp.dpp.sim.simulator import CostModel, Span, simulate
from megatronapp.dpp.tasks import FORWARD
from megatronapp.pipeline.schedules import build_schedule

REFERENCE = "interleaved/rendezvous"
SWEEP = [(4, 2, 8), (4, 2, 12), (4, 2, 16), (8, 2, 8), (8, 2, 16)]  # MegaDPP's goal: PP4 (x DP2) / PP8, V2, M 8-16
SWEEP_SKIPPED = {(8, 2, 12): "interleaved 1F1B needs M divisible by PP"}


def variants(pp: int, vpp: int, m: int, traversals, cap_extra: tuple[int, ...] = ()) -> dict:
    """Name -> simulate(...) keyword arguments. `cap_extra`: also dynamic depth-first with that
    many more slots per rank than interleaved holds (what memory buys; not the same cap)."""
    caps = compute_default_caps(pp, vpp, m)
    out = {}
    for name in ("interleaved", "looped-bfs"):
        schedule = build_schedule(name, pp, vpp, m)
        for comm in ("eager", "rendezvous"):
            out[f"{name}/{comm}"] = dict(schedule=schedule, static_comm=comm)
    for traversal in traversals:
        out[f"dynamic-{traversal}"] = dict(traversal=traversal, caps=caps)
    for extra in cap_extra:
        out[f"dynamic-depth-first/cap+{extra}"] = dict(traversal="depth-first", caps=[c + extra for c in caps])
    return out


def lower_bounds_s(cost: CostModel, pp: int, vpp: int, m: int) -> tuple[float, float]:
    """(clairvoyant bound, online bound) of the module docstring at any cap, for the seeds in
    `cost.jitter` (megatronapp/dpp/sim/bounds.py; its "expected" mode is the online bound)."""
    return (
        compute_step_bound_s(cost, pp, vpp, m, mode="clairvoyant"),
        compute_step_bound_s(cost, pp, vpp, m, mode="expected"),
    )


def study_config(
    base: CostModel, m: int, scenarios, seeds: int, traversals, on_result=None, cap_extra: tuple[int, ...] = ()
) -> dict:
    """Scenario -> {"runs": {variant: [seconds per seed]}, "rows": {variant: summary}} for the
    pipeline of `base` (its task times and link; the scenario adds jitter and link delays).
    `on_result(scenario, variant, seed, SimResult)` sees every simulation (memory reports)."""
    pp, vpp = len(base.forward_s), len(base.forward_s[0])
    kinds = variants(pp, vpp, m, traversals, cap_extra)
    results = {}
    for scen in scenarios:
        runs = {"bound": [], "online": [], **{name: [] for name in kinds}}
        for seed in range(seeds):
            cost = replace(base, **compute_scenario_sim(scen, pp, seed))
            for name, value in zip(("bound", "online"), lower_bounds_s(cost, pp, vpp, m)):
                runs[name].append(value)
            for name, kw in kinds.items():
                res = simulate(pp, vpp, m, cost, **kw)
                runs[name].append(res.makespan_s)
                if on_result is not None:
                    on_result(scen, name, seed, res)
        results[scen] = {"runs": runs, "rows": summarize_study(runs)}
    return results


def summarize_study(runs: dict) -> dict:
    """Per variant: mean seconds, speed vs the reference (ratio of means), per-seed ratio spread."""
    ref = runs[REFERENCE]
    rows = {}
    for name, times in runs.items():
        per_seed = [r / t for r, t in zip(ref, times)]
        rows[name] = {
            "mean_s": statistics.fmean(times),
            "speed": statistics.fmean(ref) / statistics.fmean(times),
            "speed_min": min(per_seed),
            "speed_max": max(per_seed),
        }
    return rows


DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def compute_message_bytes(micro_batch: int, seq_length: int, hidden_size: int, dtype: str) -> int:
    """Bytes of one P2P message: a microbatch's residual stream (B, S, H), or its gradient."""
    return micro_batch * seq_length * hidden_size * DTYPE_BYTES[dtype]


def compute_link_cost(traced: CostModel, message_bytes: int, bandwidth_GBps: float, latency_us: float) -> CostModel:
    """The traced task times with the link model: a message takes latency + bytes / bandwidth."""
    if bandwidth_GBps <= 0 or latency_us < 0 or message_bytes < 0:
        raise ValueError(
            f"needs a bandwidth > 0, latency >= 0 and bytes >= 0, got {bandwidth_GBps} GB/s, "
            f"{latency_us} us, {message_bytes} B"
        )
    return replace(
        traced, p2p_latency_s=latency_us * 1e-6, p2p_bandwidth_Bps=bandwidth_GBps * 1e9, message_bytes=message_bytes
    )


def compute_peak_activation_bytes(spans: list[Span], set_bytes, pp_size: int) -> list[int]:
    """Peak bytes of activation sets held per pipeline rank over a simulated step: F(c, m) holds
    set_bytes[p][c] from its start until B(c, m) ends (the in-flight counter's rule: a backward
    ending at the instant a forward starts frees first)."""
    events: list[list] = [[] for _ in range(pp_size)]
    for s in spans:
        if s.task.kind is FORWARD:
            events[s.pp_rank].append((s.start_s, 1, set_bytes[s.pp_rank][s.task.chunk]))
        else:
            events[s.pp_rank].append((s.end_s, 0, -set_bytes[s.pp_rank][s.task.chunk]))
    peaks = []
    for rank_events in events:
        held = peak = 0
        for _, _, delta in sorted(rank_events):
            held += delta
            peak = max(peak, held)
        peaks.append(peak)
    return peaks
