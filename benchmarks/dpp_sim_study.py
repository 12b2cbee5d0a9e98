"""MegaDPP in the simulator: dynamic policies vs static schedules under jitter, and two bounds.

Pure and fast (no processes). Per configuration (PP, V, M) and scenario (balanced, jitter1,
jitter2, link: megatronapp/dpp/sim/scenarios.py, the ones dpp_bench.py runs), over --seeds jitter
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
Both are computed by megatronapp/dpp/sim/bounds.py (the study itself: megatronapp/dpp/sim/study.py) (with any cap), which also takes, beside all of
p's tasks, the later task classes alone (a higher bound when M is small next to P), so they
are at least the formula above.
Costs default to the 8-rank CPU job's proportions (F 10 ms, B 20 ms per 1-layer chunk,
0.5 ms per message).

    python benchmarks/dpp_sim_study.py                    # PP4 V2 M8
    python benchmarks/dpp_sim_study.py --pp 8 -m 16 --json out.json
    python benchmarks/dpp_sim_study.py --sweep --seeds 20 --json sweep.json   # the goal's configs
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from megatronapp.dpp.scheduler import compute_default_caps
from megatronapp.dpp.sim.scenarios import SCENARIOS
from megatronapp.dpp.sim.simulator import CostModel
from megatronapp.dpp.sim.study import REFERENCE, SWEEP, SWEEP_SKIPPED, study_config


def print_table(title: str, results: dict) -> None:
    names = list(next(iter(results.values()))["rows"])
    print(f"\n{title}\n| scenario | " + " | ".join(names) + " |")
    print("| --- " * (len(names) + 1) + "|")
    for scen, res in results.items():
        cells = [
            f"{r['mean_s'] * 1e3:.1f} x{r['speed']:.3f} ({r['speed_min']:.2f}..{r['speed_max']:.2f})"
            for r in res["rows"].values()
        ]
        print(f"| {scen} | " + " | ".join(cells) + " |")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pp", type=int, default=4)
    p.add_argument("--vpp", type=int, default=2)
    p.add_argument("-m", "--microbatches", type=int, default=8)
    p.add_argument("--sweep", action="store_true", help=f"every config of the goal: (PP, V, M) in {SWEEP}")
    p.add_argument("--forward-ms", type=float, default=10.0)
    p.add_argument("--backward-ms", type=float, default=20.0)
    p.add_argument("--latency-ms", type=float, default=0.5)
    p.add_argument(
        "--dynamic-overhead-ms",
        type=float,
        default=0.0,
        help="host time the dynamic runtime adds per task (decision, receiver threads); static: none",
    )
    p.add_argument("--seeds", type=int, default=30)
    p.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=list(SCENARIOS))
    p.add_argument("--traversals", nargs="+", default=["depth-first", "breadth-first", "adaptive", "in-order"])
    p.add_argument(
        "--cap-extra",
        type=int,
        nargs="*",
        default=[],
        metavar="K",
        help="also dynamic depth-first with K more slots per rank than interleaved's cap",
    )
    p.add_argument("--json", default=None, help="also write the tables here")
    return p


def parse_args(argv):
    p = build_parser()
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
    print(
        f"F {a.forward_ms} ms, B {a.backward_ms} ms per chunk, {a.latency_ms} ms per message, dynamic "
        f"+{a.dynamic_overhead_ms} ms per task, {a.seeds} seeds; "
        f"cells: mean ms per iteration, xN speed vs {REFERENCE} (ratio of means), (min..max per seed)"
    )
    out = {}
    for pp, vpp, m in configs:
        base = CostModel.uniform(
            pp,
            vpp,
            a.forward_ms / 1e3,
            a.backward_ms / 1e3,
            p2p_latency_s=a.latency_ms / 1e3,
            decision_s=a.dynamic_overhead_ms / 1e3,
        )
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
