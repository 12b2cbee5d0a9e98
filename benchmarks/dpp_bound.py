"""Is 1.10x reachable? Static interleaved 1F1B, our dynamic policies and a provable bound on ANY order.

Pure simulator, CPU, one core, well under 5 minutes. For each of the issue's configurations
(dpp_sim_study.SWEEP: PP4 and PP8, V2, M 8-16) and scenario (scenarios.py: balanced, jitter1 =
pp 2 per task U[1, 1.5], jitter2 = pp 1 and pp 2 so, link = pp 1 -> pp 2 + 5 ms; plus slow1 =
pp 2 constantly 1.5x, what `--inject-slowdown` does) and --seeds jitter seeds (the deterministic
scenarios run once), per seed:
  (a) static interleaved 1F1B under both comm models (static_agents.py): "rendezvous" is the
      static runtime on gloo (the issue's baseline as measured), "eager" the same order with
      every receive posted ahead (what our dynamic runtime's in-order traversal runs);
  (b) the dynamic traversals at interleaved's per-rank in-flight cap (achieved policies);
  (c) bounds (dpp/sim/bounds.py), NOT achieved by any policy: `bound` = the clairvoyant lower bound
      on the step time of any order at that cap, even one knowing every jitter draw (per seed);
      `expected` = the lower bound on the MEAN step time of any order that cannot see a draw
      before choosing (every real policy), compared as a ratio of means.
Speeds are reference time / variant time per seed (for `bound`: the most any order could
reach on that seed); cells give the median and the 2.5-97.5 percentile range over seeds.
"ge1.10" is the share of seeds on which the bound leaves 1.10x possible. Costs default to the
16-core host's per-chunk task times (BENCHMARKS.md: F 4.3 / B 8.6 ms, 0.5 ms per message).

    python benchmarks/dpp_bound.py --seeds 30 --json out/dpp_bound.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dpp_order_search import search_orders  # noqa: E402
from dpp_sim_study import SWEEP  # noqa: E402

from megatronapp.dpp.sim.bounds import compute_step_bound_s  # noqa: E402
from megatronapp.dpp.sim.scenarios import SCENARIOS, compute_scenario_sim  # noqa: E402
from megatronapp.dpp.scheduler import compute_default_caps  # noqa: E402
from megatronapp.dpp.sim.simulator import CostModel, simulate  # noqa: E402
from megatronapp.pipeline.schedules import build_schedule  # noqa: E402

BOUND_SCENARIOS = (*SCENARIOS, "slow1")
DETERMINISTIC = ("balanced", "link", "slow1")
SLOW_RANK, SLOW_FACTOR = 2, 1.5  # slow1: the stage jitter1 jitters, constantly at its maximum
REFERENCES = ("interleaved/rendezvous", "interleaved/eager")
TARGET = 1.10
# Static interleaved ms/iteration measured on the 16-core host (BENCHMARKS.md, MegaDPP: session 4
# PP4 x DP2 M8 medians over 3 repeats; session 6 PP8 M16 medians over 2-3 repeats).
REAL_INTERLEAVED_MS = {(4, 2, 8): {"balanced": 263.1, "jitter1": 295.4, "jitter2": 305.6, "link": 330.1},
                       (8, 2, 16): {"balanced": 555.6, "jitter1": 595.0, "jitter2": 615.0, "link": 650.9}}


def scenario_cost(base: CostModel, name: str, pp: int, seed: int) -> CostModel:
    """`base` with scenario `name`'s perturbation for jitter seed `seed`."""
    if name != "slow1":
        return replace(base, **compute_scenario_sim(name, pp, seed))
    scale = lambda table: tuple(tuple(t * (SLOW_FACTOR if r == SLOW_RANK else 1.0) for t in row)  # noqa: E731
                                for r, row in enumerate(table))
    return replace(base, forward_s=scale(base.forward_s), backward_s=scale(base.backward_s))


def run_cell(base: CostModel, m: int, scen: str, seeds: int, traversals, search: tuple[int, int] = (0, 0)) -> dict:
    """Variant -> seconds per seed; 'bound' / 'bound-nocap' per seed; 'expected' (one number);
    'search' (search = (moves, seeds) > 0): the clairvoyant order search's best on the first seeds."""
    pp, vpp = len(base.forward_s), len(base.forward_s[0])
    caps, schedule = compute_default_caps(pp, vpp, m), build_schedule("interleaved", pp, vpp, m)
    runs = {name: [] for name in (*REFERENCES, *(f"dynamic-{t}" for t in traversals), "bound", "bound-nocap")}
    moves, search_seeds = search
    searched = []
    for seed in range(1 if scen in DETERMINISTIC else seeds):
        cost = scenario_cost(base, scen, pp, seed)
        for ref in REFERENCES:
            runs[ref].append(simulate(pp, vpp, m, cost, schedule=schedule, static_comm=ref.split("/")[1]).makespan_s)
        for t in traversals:
            runs[f"dynamic-{t}"].append(simulate(pp, vpp, m, cost, traversal=t, caps=caps).makespan_s)
        runs["bound"].append(compute_step_bound_s(cost, pp, vpp, m, caps))
        runs["bound-nocap"].append(compute_step_bound_s(cost, pp, vpp, m))
        if moves and seed < search_seeds:
            searched.append(search_orders(cost, pp, vpp, m, caps, moves, seed)[1])
    expected = compute_step_bound_s(scenario_cost(base, scen, pp, 0), pp, vpp, m, caps, mode="expected")
    return {"caps": caps, "runs": runs, "expected_s": expected, "search_s": searched}


def spread(values: list[float]) -> dict:
    lo, hi = np.percentile(values, [2.5, 97.5])
    return {"median": statistics.median(values), "lo": float(lo), "hi": float(hi)}


def summarize(cell: dict, reference: str) -> dict:
    """Per variant and bound: per-seed speed vs `reference` (median, 95% range); the expected
    bound as a ratio of means; the share of seeds where the bound leaves TARGET possible."""
    ref = cell["runs"][reference]
    rows = {name: spread([r / t for r, t in zip(ref, times)]) for name, times in cell["runs"].items()}
    rows["expected"] = {"ratio_of_means": statistics.fmean(ref) / cell["expected_s"]}
    rows["bound"]["share_ge_target"] = sum(r / b >= TARGET for r, b in zip(ref, cell["runs"]["bound"])) / len(ref)
    if cell["search_s"]:
        rows["search"] = spread([r / t for r, t in zip(ref, cell["search_s"])])
        rows["search"]["n"] = len(cell["search_s"])
    return rows


def _fmt(s: dict) -> str:
    if s["lo"] == s["hi"]:
        return f"{s['median']:.3f}"
    return f"{s['median']:.3f} [{s['lo']:.3f}, {s['hi']:.3f}]"


def print_tables(label: str, cells: dict, reference: str) -> None:
    first = next(iter(cells.values()))
    names = [n for n in first["runs"] if n != reference]
    print(f"\n{label}: speed vs {reference}, median [2.5%, 97.5%] over seeds")
    print("| scenario | ref ms | " + " | ".join(names) + f" | expected bound | seeds bound >= {TARGET} | search |")
    print("| --- " * (len(names) + 5) + "|")
    for scen, cell in cells.items():
        rows = summarize(cell, reference)
        ref_ms = statistics.median(cell["runs"][reference]) * 1e3
        found = f"{_fmt(rows['search'])} (n={rows['search']['n']})" if "search" in rows else "-"
        print(f"| {scen} | {ref_ms:.1f} | " + " | ".join(_fmt(rows[n]) for n in names)
              + f" | {rows['expected']['ratio_of_means']:.3f} | {rows['bound']['share_ge_target']:.0%} | {found} |")


def print_real(config: tuple, cells: dict) -> None:
    real = {scen: ms for scen, ms in REAL_INTERLEAVED_MS.get(config, {}).items() if scen in cells}
    if not real:
        return
    print(f"\nmeasured static interleaved (16-core host) / simulated bound, PP{config[0]} V{config[1]} M{config[2]}:")
    for scen, ms in real.items():
        bound_ms = statistics.median(cells[scen]["runs"]["bound"]) * 1e3
        print(f"  {scen:<9} {ms:.1f} ms / bound {bound_ms:.1f} ms = {ms / bound_ms:.3f}; "
              f"/ expected bound {cells[scen]['expected_s'] * 1e3:.1f} ms = {ms / (cells[scen]['expected_s'] * 1e3):.3f}")


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, default=30)
    p.add_argument("--forward-ms", type=float, default=4.3)
    p.add_argument("--backward-ms", type=float, default=8.6)
    p.add_argument("--latency-ms", type=float, default=0.5)
    p.add_argument("--configs", nargs="+", default=[f"{pp}x{v}x{m}" for pp, v, m in SWEEP], metavar="PxVxM")
    p.add_argument("--scenarios", nargs="+", default=list(BOUND_SCENARIOS), choices=list(BOUND_SCENARIOS))
    p.add_argument("--traversals", nargs="+", default=["depth-first", "breadth-first", "adaptive", "in-order"])
    p.add_argument("--search-moves", type=int, default=1000,
                   help="moves of the clairvoyant order search per seed (0: no search)")
    p.add_argument("--search-seeds", type=int, default=5, help="jittered seeds the search runs on (the first ones)")
    p.add_argument("--json", default=None, help="also write every per-seed time and summary here")
    a = p.parse_args(argv)
    try:
        a.configs = [tuple(int(x) for x in c.split("x")) for c in a.configs]
    except ValueError:
        p.error(f"--configs expects PxVxM like 4x2x8, got {a.configs}")
    if any(len(c) != 3 or c[0] < 3 or c[1] < 2 or c[2] % c[0] for c in a.configs):
        p.error("each config needs P >= 3 (the scenarios perturb stages 1 and 2), V >= 2, M divisible by P")
    if a.seeds < 1 or min(a.forward_ms, a.backward_ms) <= 0 or a.latency_ms < 0:
        p.error("needs --seeds >= 1, positive task times and a latency >= 0")
    if a.search_moves < 0 or a.search_seeds < 0:
        p.error("needs --search-moves >= 0 and --search-seeds >= 0")
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    print(f"F {a.forward_ms} ms, B {a.backward_ms} ms per chunk, {a.latency_ms} ms per message, {a.seeds} seeds "
          f"(deterministic scenarios {', '.join(DETERMINISTIC)}: one run)")
    out = {}
    for pp, vpp, m in a.configs:
        base = CostModel.uniform(pp, vpp, a.forward_ms / 1e3, a.backward_ms / 1e3, p2p_latency_s=a.latency_ms / 1e3)
        search = (a.search_moves, min(a.search_seeds, a.seeds))
        cells = {scen: run_cell(base, m, scen, a.seeds, a.traversals, search) for scen in a.scenarios}
        label = f"PP{pp} V{vpp} M{m}, caps {compute_default_caps(pp, vpp, m)}"
        for reference in REFERENCES:
            print_tables(label, cells, reference)
        print_real((pp, vpp, m), cells)
        out[f"PP{pp}V{vpp}M{m}"] = {scen: {**cell, "summary": {ref: summarize(cell, ref) for ref in REFERENCES}}
                                    for scen, cell in cells.items()}
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        tmp = a.json + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"args": {**vars(a), "configs": [list(c) for c in a.configs]}, "results": out}, f, indent=1)
        os.replace(tmp, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
