"""MegaDPP in the simulator: dynamic policies vs static schedules under jitter, and the bound.

Pure and fast (no processes). For each scenario the mean iteration time over --seeds jitter
seeds of: static interleaved 1F1B and static breadth-first, each under both comm models
(static_agents.py: "eager" = a static order whose receives are all posted ahead;
"rendezvous" = what the static runtime does on gloo, batches waited whole and sends that
move only once the receiver posted), and the dynamic traversals at interleaved's per-rank
cap. `bound` is a lower bound on the iteration time of *any* schedule, per seed, averaged:
    max over pp ranks p of  head(p) + work(p) + tail(p)
where work(p) is p's least possible compute: its task times paired with the seed's jitter
factors for p (drawn in run order, as the simulator does) so that the largest factors fall
on the shortest tasks (rearrangement inequality: no run order does better); head(p) the
earliest its first input can arrive (the forwards of virtual stages 0..p-1 at their
unjittered cost, plus the links) and tail(p) the least time from p's last task (always the
backward of its chunk 0) to the end (the backwards of virtual stages p-1..0, plus the links).
Costs default to the 8-rank CPU job's proportions (F 10 ms, B 20 ms, 0.5 ms per message).

    python benchmarks/dpp_sim_study.py                    # PP4 V2 M8, the dpp_bench scenarios
    python benchmarks/dpp_sim_study.py --pp 8 -m 16 --json out.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys

from megatronapp.dpp.config import JitterSpec
from megatronapp.dpp.scheduler import compute_default_caps
from megatronapp.dpp.simulator import CostModel, simulate
from megatronapp.dpp.tasks import forward_task
from megatronapp.pipeline.schedules import build_schedule


def scenarios(pp: int) -> dict:
    """Name -> (jitter specs factory over a seed, link delays), as pipeline ranks.

    They mirror dpp_bench.py's on PP4 x DP2 (global rank 4 is pp 2, rank 2 is pp 1)."""
    slow, up = min(2, pp - 1), min(1, pp - 2)
    return {
        "balanced": (lambda s: (), ()),
        "jitter1": (lambda s: (JitterSpec(slow, 1.5, s),), ()),
        "jitter2": (lambda s: (JitterSpec(up, 1.5, 2 * s + 1), JitterSpec(slow, 1.5, 2 * s + 2)), ()),
        "link": (lambda s: (), ((up, slow, 5e-3),)),
    }


def variants(a) -> dict:
    """Name -> simulate(...) keyword arguments."""
    caps = compute_default_caps(a.pp, a.vpp, a.microbatches)
    out = {}
    for name in ("interleaved", "breadth-first"):
        schedule = build_schedule(name, a.pp, a.vpp, a.microbatches)
        for comm in ("eager", "rendezvous"):
            out[f"{name}/{comm}"] = dict(schedule=schedule, static_comm=comm)
    for traversal in a.traversals:
        out[f"dynamic-{traversal}"] = dict(traversal=traversal, caps=caps)
    return out


def lower_bound_s(cost: CostModel, pp: int, vpp: int, m: int) -> float:
    """The bound in the module docstring, for the seeds in `cost.jitter`."""
    factors = {j.rank: j for j in cost.jitter}
    bound = 0.0
    for p in range(pp):
        tasks = sorted((t for c in range(vpp) for t in (cost.forward_s[p][c], cost.backward_s[p][c])
                        for _ in range(m)), reverse=True)
        if p in factors:  # the simulator's draws for this rank, smallest on the longest tasks
            rng, top = random.Random(f"{factors[p].seed}:{p}"), factors[p].max_factor
            drawn = sorted(rng.uniform(1.0, top) for _ in tasks)
            tasks = [t * f for t, f in zip(tasks, drawn)]
        head = sum(cost.task_s(q, forward_task(0, 0)) + cost.transfer_s(q, q + 1) for q in range(p))
        tail = sum(cost.backward_s[q][0] + cost.transfer_s(q + 1, q) for q in range(p))
        bound = max(bound, head + sum(tasks) + tail)
    return bound


def study(a) -> dict:
    results = {}
    for scen, (jitter_of, links) in scenarios(a.pp).items():
        base = dict(p2p_latency_s=a.latency_ms / 1e3, link_delay_s=links)
        runs = {"bound_s": [], **{name: [] for name in variants(a)}}
        for seed in range(a.seeds):
            cost = CostModel.uniform(a.pp, a.vpp, a.forward_ms / 1e3, a.backward_ms / 1e3, jitter=jitter_of(seed),
                                     **base)
            runs["bound_s"].append(lower_bound_s(cost, a.pp, a.vpp, a.microbatches))
            for name, kw in variants(a).items():
                runs[name].append(simulate(a.pp, a.vpp, a.microbatches, cost, **kw).makespan_s)
        results[scen] = {n: statistics.fmean(r) for n, r in runs.items()}
    return results


def print_table(results: dict) -> None:
    names = [n for n in next(iter(results.values())) if n != "bound_s"]
    print("| scenario | bound | " + " | ".join(names) + " |")
    print("| --- " * (len(names) + 2) + "|")
    for scen, row in results.items():
        ref = row["interleaved/rendezvous"]
        cells = [f"{row[n] * 1e3:.1f} (x{ref / row[n]:.3f})" for n in names]
        print(f"| {scen} | {row['bound_s'] * 1e3:.1f} (x{ref / row['bound_s']:.3f}) | " + " | ".join(cells) + " |")
    print("ms per iteration, mean over seeds; (xN) = speed relative to interleaved/rendezvous (the static runtime);"
          " the bound's xN is the most any schedule can gain")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pp", type=int, default=4)
    p.add_argument("--vpp", type=int, default=2)
    p.add_argument("-m", "--microbatches", type=int, default=8)
    p.add_argument("--forward-ms", type=float, default=10.0)
    p.add_argument("--backward-ms", type=float, default=20.0)
    p.add_argument("--latency-ms", type=float, default=0.5)
    p.add_argument("--seeds", type=int, default=30)
    p.add_argument("--traversals", nargs="+", default=["depth-first", "breadth-first", "adaptive", "in-order"])
    p.add_argument("--json", default=None, help="also write the table here")
    a = p.parse_args(argv)
    if a.pp < 3 or a.microbatches % a.pp:
        print("dpp_sim_study: error: needs --pp >= 3 and -m divisible by --pp (interleaved)", file=sys.stderr)
        return 2
    results = study(a)
    print(f"PP{a.pp} V{a.vpp} M{a.microbatches}, F {a.forward_ms} ms, B {a.backward_ms} ms, "
          f"{a.latency_ms} ms per message, {a.seeds} seeds")
    print_table(results)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
