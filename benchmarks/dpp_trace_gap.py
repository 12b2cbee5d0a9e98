"""Where a measured pipeline-schedule speed-up departs from the simulator's: traced dpp_bench cells.

`dpp_bench.py --trace-cells` traces one extra pass of every (scenario, variant) cell into
OUT/traces/SCENARIO__VARIANT. For each traced cell this reads one pipeline (tp 0, dp 0) and
gives, from the trace alone, over the iterations after --warmup:
  measured   mean iteration: first task start to last task end
  busy       per pp rank, the share of the iteration inside its compute spans
  fwd / bwd  mean task ms per pp rank (a jittered rank's draws included)
  host gap   per pp rank, mean gap between its consecutive tasks when the second one's input
             had already arrived (posting communication, bookkeeping, the decision; for the
             static runtime also its sends' waits for a slow receiver)
  p2p        mean delay from a producer's end to a waiting consumer's start
and, from the simulator, `predicted`: the mean over --seeds jitter draws of the simulated
iteration, with this cell's task times (a jittered rank's divided by its mean factor, as
the simulator draws the jitter again, in run order, as the injector does), this cell's
host gap and link delays, and the p2p delay of the variant's balanced cell (this cell's
would hold a delayed link's delay, which the simulator adds itself). Everything but p2p
comes from the cell itself, so a host that drifts between cells does not show as error. Static variants are simulated with eager communication, as
`megatronapp schedule simulate --from-trace` does (the fitted host gap holds their waits).
Per scenario it then sets each variant's measured speed over interleaved beside the
predicted one: if the two variants' task times are alike and their predictions are right,
the simulator's ratio stands; a variant measured well above its own prediction loses time
the model does not have, and which of busy, host gap or p2p moved says where.

    python benchmarks/dpp_bench.py --pp 8 --microbatches 16 --num-layers 16 --iters 7 --warmup 2 \\
        --repeats 8 --scenarios balanced jitter2 --variants interleaved dynamic-inorder --trace-cells --out OUT
    python benchmarks/dpp_trace_gap.py OUT --warmup 2 --json OUT/trace_gap.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from megatronapp.dpp.sim.trace_gap import analyse, load_cells


def _fmt(values: list[float], spec: str) -> str:
    return " ".join(format(v, spec) for v in values)


def print_report(result: dict) -> None:
    for scenario, rows in result.items():
        print(f"\n{scenario}")
        for variant, r in rows.items():
            pred = f"{r['predicted_ms']:.1f}" if r["predicted_ms"] else "-"
            err = f" ({r['measured_ms'] / r['predicted_ms'] - 1:+.1%} vs predicted)" if r["predicted_ms"] else ""
            print(f"  {variant:<17} measured {r['measured_ms']:.1f} ms, predicted {pred} ms{err}, n={r['iterations']}")
            print(
                f"  {'':<17} busy {_fmt(r['busy'], '.0%')}; fwd ms {_fmt(r['fwd_ms'], '.2f')}; "
                f"bwd ms {_fmt(r['bwd_ms'], '.2f')}; host gap ms {_fmt(r['host_gap_ms'], '.3f')}; "
                f"p2p {r['p2p_ms']:.3f} ms"
            )
            if "measured_speed" in r:
                pred_speed = f"x{r['predicted_speed']:.3f}" if "predicted_speed" in r else "-"
                print(f"  {'':<17} speed over interleaved: measured x{r['measured_speed']:.3f}, predicted {pred_speed}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out", type=Path, help="a dpp_bench.py --out directory run with --trace-cells")
    p.add_argument("--warmup", type=int, default=2, help="traced iterations to leave out (dpp_bench's --warmup)")
    p.add_argument("--seeds", type=int, default=8, help="jitter draws to average each prediction over")
    p.add_argument("--json", type=Path, default=None)
    return p


def main(argv=None) -> int:
    p = build_parser()
    a = p.parse_args(argv)
    try:
        cells = load_cells(a.out, a.warmup)
    except ValueError as exc:
        p.error(str(exc))
    result = analyse(cells, a.seeds)
    print_report(result)
    if a.json:
        tmp = a.json.with_suffix(".tmp")
        tmp.write_text(json.dumps(result, indent=1))
        tmp.replace(a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
