"""Host cost of one MegaScan span, without a model: what full granularity adds per span.

    python benchmarks/scan_span_cost.py --device cuda   # H200
    python benchmarks/scan_span_cost.py --device cpu    # the host clock only

Measures, on the training thread, microseconds per call of: the clock's mark alone; an empty
`layer_span` (open + close = two marks); one of an adjacent pair (attention, then its MLP starting
at the attention's end mark: three marks a pair, as the engine's layers); the same while the GPU
is busy with queued work (a launch queue that is not empty, as in a real step); and on the
writer's side the conversion of recorded spans into a batch (`build_window_batch`) once the GPU
has passed them. Medians over --repeats of --n calls each, with the range.
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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from megatronapp import spans  # noqa: E402
from megatronapp.scan.record.format import build_rank_meta  # noqa: E402
from megatronapp.scan.record.trace_writer import build_window_batch  # noqa: E402
from megatronapp.scan.record.tracer import TraceConfig, Tracer  # noqa: E402


def _per_call_us(fn, n: int, repeats: int) -> dict:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(n)
        times.append((time.perf_counter() - t0) / n * 1e6)
    return {"median_us": statistics.median(times), "range_us": [min(times), max(times)]}


def measure(device: torch.device, n: int, repeats: int) -> dict:
    meta = build_rank_meta(rank=0, world_size=1, coords={"tp": 0, "dp": 0, "pp": 0},
                           layout={"tp_size": 1, "pp_size": 1, "dp_size": 1, "virtual_pp_size": 1},
                           host="bench", device=str(device), run_id="span_cost", clock="monotonic")
    cuda = device.type == "cuda"
    with tempfile.TemporaryDirectory() as d:
        tracer = Tracer(TraceConfig(enabled=True, trace_dir=d, interval=1, granularity="full",
                                    flush_seconds=3600.0), meta, device)
        clock = tracer._clock
        tracer.step_begin(1)
        out: dict = {"device": str(device), "clock": clock.name, "n": n, "repeats": repeats}

        def drop_records() -> None:  # what the writer would do, minus writing: marks back to the pool
            if cuda:
                torch.cuda.synchronize()
            recs, tracer._records = tracer._records, []
            clock.release([m for r in recs for m in (r[2], r[3])])

        def marks(k: int) -> None:
            made = [clock.mark() for _ in range(k)]
            clock.release(made)

        def layer_spans(k: int) -> None:
            for _ in range(k):
                with tracer.layer_span(spans.ATTENTION, 3):
                    pass
            drop_records()

        def layer_pairs(k: int) -> None:  # as the engine's layers: attention, then its MLP from its end
            for _ in range(k // 2):
                with tracer.layer_span(spans.ATTENTION, 3) as attention:
                    pass
                with tracer.layer_span(spans.MLP, 3, after=attention):
                    pass
            drop_records()

        with tracer.context(chunk=0, microbatch=0):
            out["mark"] = _per_call_us(marks, n, repeats)
            out["layer_span"] = _per_call_us(layer_spans, n, repeats)
            out["layer_span_in_adjacent_pair"] = _per_call_us(layer_pairs, n, repeats)
            if cuda:
                a = torch.randn(2048, 2048, device=device)

                def busy_layer_spans(k: int) -> None:
                    for _ in range(k):
                        with tracer.layer_span(spans.ATTENTION, 3):
                            a.add_(1.0)  # one small kernel per span: the queue stays busy
                    drop_records()

                def kernels_only(k: int) -> None:
                    for _ in range(k):
                        a.add_(1.0)
                    torch.cuda.synchronize()

                out["kernel_alone"] = _per_call_us(kernels_only, n, repeats)
                out["kernel_in_layer_span"] = _per_call_us(busy_layer_spans, n, repeats)

            def convert(k: int) -> None:
                for _ in range(k):
                    with tracer.layer_span(spans.ATTENTION, 3):
                        pass
                recs, tracer._records = tracer._records, []
                clock.wait_recorded([r[3] for r in recs[-1:]])
                t0 = time.perf_counter()
                build_window_batch(recs, clock, [])
                convert.spent += time.perf_counter() - t0

            times = []
            for _ in range(repeats):
                convert.spent = 0.0
                convert(n)
                times.append(convert.spent / n * 1e6)
            out["writer_convert_per_span"] = {"median_us": statistics.median(times), "range_us": [min(times), max(times)]}
        tracer.step_end(1)
        tracer.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--n", type=int, default=2000, help="calls per repeat")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("CUDA is not available: use --device cpu")
    result = measure(device, args.n, args.repeats)
    for key, value in result.items():
        if isinstance(value, dict):
            print(f"{key:26s} {value['median_us']:8.2f} us  ({value['range_us'][0]:.2f}..{value['range_us'][1]:.2f})")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
