"""MegaDPP in the simulator: dynamic policies vs static schedules under jitter, and two bounds.

Pure and fast (no processes). Per configuration (PP, V, M) and scenario (balanced, jitter1,
jitter2, link: megatronapp/dpp/scenarios.py, the ones dpp_bench.py runs), over --seeds jitter
seeds: static interleaved 1F1B and static breadth-first, each under both comm models
(static_agents.py: "eager" = a static order whose receives are all posted ahead;
"rendezvous" = what the static runtime does on gloo, batches waited whole and sends that
move only once the receiver posted), and the dynamic traversals at interleaved's per-rank
cap. The reference is interleaved/rendezvous (the static runtime). Per variant the table
gives ms per iteration (mean over seeds), speed vs the reference (ratio of means) and the
spread of the per-seed speed ratios (min..max). Two lower bounds, per seed:
    max over pp ranks p of  head(p) + work(p) + tail(p)
where head(p) is the earliest p's first input can arrive (the forwards of virtual stages
0..p-1 at their unjittered cost, plus the links) and tail(p) the least time from p's last
task (always the backward of its chunk 0) to the end (the backwards of virtual stages
p-1..0, plus the links). work(p) is p's least compute:
  * `bound` (clairvoyant): its task times paired with the seed's jitter factors for p
    (drawn in run order, as the simulator does) so that the largest factors fall on the
    shortest tasks (rearrangement inequality: no run order does better);
  * `online`: its task times times the mean factor (1 + max) / 2. A policy that does not
    know a task's factor before running it (every real one: the factor is the machine's)
    gets each draw independently of the task it runs, so E[work] is this, and
    E[makespan] >= max_p E[head + work + tail]: no real schedule beats it on average.
Both are computed by megatronapp/dpp/bounds.py (with any cap), which also takes, beside all of
p's tasks, the later task classes alone (a higher bound when M is small next to P), so they
are at least the formula above.
Costs default to the 8-rank CPU job's proportions (F 10 ms, B 20 ms per 1-layer chunk,
0.5 ms per message).

    python benchmarks/dpp_sim_study.py                    # PP4 V2 M8
    python benchmarks/dpp_sim_study.py --pp 8 -m 16 --json out.json
    python benchmarks/dpp_sim_study.py --sweep --seeds 20 --json sweep.json   # the issue's configs
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from dataclasses import replace

from megatronapp.dpp.bounds import compute_step_bound_s
from megatronapp.dpp.scenarios import SCENARIOS, compute_scenario_sim
from megatronapp.dpp.scheduler import compute_default_caps
from megatronapp.dpp.simulator import CostModel, simulate
from megatronapp.pipeline.schedules import build_schedule

REFERENCE = "interleaved/rendezvous"
SWEEP = [(4, 2, 8), (4, 2, 12), (4, 2, 16), (8, 2, 8), (8, 2, 16)]  # the PP4 (x DP2) / PP8, V2, M 8-16
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
    `cost.jitter` (megatronapp/dpp/bounds.py; its "expected" mode is the online bound)."""
    return (compute_step_bound_s(cost, pp, vpp, m, mode="clairvoyant"),
            compute_step_bound_s(cost, pp, vpp, m, mode="expected"))


def study_config(base: CostModel, m: int, scenarios, seeds: int, traversals, on_result=None,
                 cap_extra: tuple[int, ...] = ()) -> dict:
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
        results[scen] = {"runs": runs, "rows": summarize(runs)}
    return results


def summarize(runs: dict) -> dict:
    """Per variant: mean seconds, speed vs the reference (ratio of means), per-seed ratio spread."""
    ref = runs[REFERENCE]
    rows = {}
    for name, times in runs.items():
        per_seed = [r / t for r, t in zip(ref, times)]
        rows[name] = {"mean_s": statistics.fmean(times), "speed": statistics.fmean(ref) / statistics.fmean(times),
                      "speed_min": min(per_seed), "speed_max": max(per_seed)}
    return rows


def print_table(title: str, results: dict) -> None:
    names = list(next(iter(results.values()))["rows"])
    print(f"\n{title}\n| scenario | " + " | ".join(names) + " |")
    print("| --- " * (len(names) + 1) + "|")
    for scen, res in results.items():
        cells = [f"{r['mean_s'] * 1e3:.1f} x{r['speed']:.3f} ({r['speed_min']:.2f}..{r['speed_max']:.2f})"
                 for r in res["rows"].values()]
        print(f"| {scen} | " + " | ".join(cells) + " |")


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pp", type=int, default=4)
    p.add_argument("--vpp", type=int, default=2)
    p.add_argument("-m", "--microbatches", type=int, default=8)
    p.add_argument("--sweep", action="store_true", help=f"every allowed config of the issue: (PP, V, M) in {SWEEP}")
    p.add_argument("--forward-ms", type=float, default=10.0)
    p.add_argument("--backward-ms", type=float, default=20.0)
    p.add_argument("--latency-ms", type=float, default=0.5)
    p.add_argument("--dynamic-overhead-ms", type=float, default=0.0,
                   help="host time the dynamic runtime adds per task (decision, receiver threads); static: none")
    p.add_argument("--seeds", type=int, default=30)
    p.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=list(SCENARIOS))
    p.add_argument("--traversals", nargs="+", default=["depth-first", "breadth-first", "adaptive", "in-order"])
    p.add_argument("--cap-extra", type=int, nargs="*", default=[], metavar="K",
                   help="also dynamic depth-first with K more slots per rank than interleaved's cap")
    p.add_argument("--json", default=None, help="also write the tables here")
    a = p.parse_args(argv)
    if not a.sweep and (a.pp < 3 or a.microbatches % a.pp):
        p.error("needs --pp >= 3 and -m divisible by --pp (interleaved)")
    if any(k < 0 for k in a.cap_extra):
        p.error("--cap-extra needs K >= 0")
    if a.seeds < 1 or min(a.forward_ms, a.backward_ms) <= 0 or a.latency_ms < 0 or a.dynamic_overhead_ms < 0:
        p.error("needs --seeds >= 1, positive task times and a latency >= 0")
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    configs = SWEEP if a.sweep else [(a.pp, a.vpp, a.microbatches)]
    print(f"F {a.forward_ms} ms, B {a.backward_ms} ms per chunk, {a.latency_ms} ms per message, dynamic "
          f"+{a.dynamic_overhead_ms} ms per task, {a.seeds} seeds; "
          f"cells: mean ms per iteration, xN speed vs {REFERENCE} (ratio of means), (min..max per seed)")
    out = {}
    for pp, vpp, m in configs:
        base = CostModel.uniform(pp, vpp, a.forward_ms / 1e3, a.backward_ms / 1e3, p2p_latency_s=a.latency_ms / 1e3,
                                 decision_s=a.dynamic_overhead_ms / 1e3)
        res = study_config(base, m, a.scenarios, a.seeds, a.traversals, cap_extra=tuple(a.cap_extra))
        print_table(f"PP{pp} V{vpp} M{m}, dynamic at caps {compute_default_caps(pp, vpp, m)}", res)
        out[f"PP{pp}V{vpp}M{m}"] = res
    for (pp, vpp, m), why in SWEEP_SKIPPED.items() if a.sweep else ():
        print(f"\nPP{pp} V{vpp} M{m}: not run ({why})")
    if a.json:
        tmp = a.json + ".tmp"
        with open(tmp, "w") as f:
            rows = {cfg: {scen: r["rows"] for scen, r in res.items()} for cfg, res in out.items()}
            json.dump({"args": vars(a), "results": rows}, f, indent=1)
        os.replace(tmp, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
