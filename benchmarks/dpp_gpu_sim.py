"""MegaDPP on the GPU, through the simulator calibrated on GPU task times from a MegaScan trace.

With one GPU a real PP x V pipeline (one stage per process) cannot run, so:
  1. build every virtual stage's GPT chunk of --preset split PP x V (Megatron's layer
     assignment, parallel/partition.py) on --device, in --dtype;
  2. run --iters passes; in each, every chunk runs forward then backward of each of M
     microbatches. Pass i is MegaScan iteration i (iteration 0 is never traced: warm-up), with
     one Tracer per pipeline rank writing rankNNNNN.mscan with that rank's coords, and
     "forward"/"backward" compute spans with (chunk, microbatch), as the engine records them,
     timed by the tracer's clock (CUDA events on a GPU, the monotonic clock on CPU);
  3. read the trace back with the simulator's own loader (dpp/sim/trace_costs.py: mean seconds per
     (pp rank, chunk, kind)) and add the link (`compute_link_cost`: latency + message bytes /
     bandwidth, message = one microbatch's residual stream, B x S x H in --dtype);
  4. measure each chunk's activation set: the bytes autograd keeps for one microbatch's
     backward (saved-tensor hooks; parameters excluded);
  5. simulate every scenario of dpp_bench (dpp/sim/scenarios.py: balanced, jitter1, jitter2, link
     = +5 ms per pp1 -> pp2 message) over --seeds seeds: static interleaved and breadth-first
     (both comm models), the dynamic traversals at interleaved's cap, and the bounds
     (megatronapp/dpp/sim/study.py), with speed vs the reference, peak in-flight microbatches and peak
     activation memory per pipeline rank.

    python benchmarks/dpp_gpu_sim.py --device cuda --preset 1.3b --pp 4 --vpp 2 -m 8 --out runs/dpp_gpu_sim
    python benchmarks/dpp_gpu_sim.py --device cpu --preset tiny --num-layers 8 -m 4 --seeds 2   # the CPU check
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import dpp_sim_study  # benchmarks/ is sys.path[0] when run as a script

from megatronapp.dpp.scheduler import compute_default_caps
from megatronapp.dpp.sim.scenarios import SCENARIOS
from megatronapp.dpp.sim.simulator import CostModel
from megatronapp.dpp.sim.study import (
    DTYPE_BYTES,
    compute_link_cost,
    compute_message_bytes,
    compute_peak_activation_bytes,
    study_config,
)


def build_chunks(a, torch):
    """[pp rank][chunk] -> GPTChunk of virtual stage chunk * PP + pp, on a.device in a.dtype."""
    from megatronapp.config import model_preset
    from megatronapp.model.gpt import TPContext, build_model_chunks

    overrides = {
        k: v for k, v in (("num_layers", a.num_layers), ("vocab_size", a.vocab_size), ("seq_length", a.seq_length)) if v
    }
    cfg = model_preset(a.preset, **overrides)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[a.dtype]
    tp = TPContext(None, 1, 0)
    chunks = [
        [
            c.to(dtype)
            for c in build_model_chunks(
                cfg, pp_rank=p, pp_size=a.pp, num_chunks=a.vpp, tp=tp, seed=1234, device=a.device
            )
        ]
        for p in range(a.pp)
    ]
    return cfg, chunks, dtype


def _chunk_inputs(chunk, cfg, a, dtype, torch):
    """(input, labels) of one microbatch for `chunk`: token ids for the first, hidden states after."""
    g = torch.Generator(device=a.device).manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (a.micro_batch, cfg.seq_length + 1), device=a.device, generator=g)
    labels = tokens[:, 1:] if chunk.has_head else None
    if chunk.has_embedding:
        return tokens[:, :-1], labels
    x = torch.randn(a.micro_batch, cfg.seq_length, cfg.hidden_size, device=a.device, dtype=dtype, generator=g)
    return x.requires_grad_(), labels


def measure_set_bytes(chunk, x, labels, torch) -> int:
    """Bytes autograd keeps from one forward of `chunk` for its backward (parameters excluded)."""
    params = {p.untyped_storage().data_ptr() for p in chunk.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = chunk(x, labels)
    del out
    return sum(seen.values())


def _tracers(a, trace_dir: str, torch):
    """One MegaScan Tracer per pipeline rank (rank file and coords of that stage), every
    iteration from 1 on traced."""
    from megatronapp.scan.record.format import build_rank_meta
    from megatronapp.scan.record.tracer import TraceConfig, Tracer

    device = torch.device(a.device)
    cfg = TraceConfig(enabled=True, trace_dir=trace_dir, interval=1, continuous_iterations=1)
    layout = {"tp_size": 1, "pp_size": a.pp, "dp_size": 1, "virtual_pp_size": a.vpp}
    clock = "cuda" if device.type == "cuda" else "monotonic"
    return [
        Tracer(
            cfg,
            build_rank_meta(
                rank=p,
                world_size=a.pp,
                coords={"tp": 0, "dp": 0, "pp": p},
                layout=layout,
                host="",
                device=a.device,
                run_id="dpp_gpu_sim",
                clock=clock,
                run={"schedule": "chunk-timing"},
            ),
            device,
        )
        for p in range(a.pp)
    ]


def trace_task_times(a, cfg, chunks, dtype, trace_dir: str, torch) -> list[list[int]]:
    """Run the traced passes (module docstring, step 2); returns set bytes [pp rank][chunk]."""
    from megatronapp import spans

    inputs = [[_chunk_inputs(c, cfg, a, dtype, torch) for c in row] for row in chunks]
    grads = [
        [
            None
            if c.has_head
            else torch.randn(a.micro_batch, cfg.seq_length, cfg.hidden_size, device=a.device, dtype=dtype)
            for c in row
        ]
        for row in chunks
    ]
    set_bytes = [
        [measure_set_bytes(c, *inputs[p][i], torch) for i, c in enumerate(row)] for p, row in enumerate(chunks)
    ]
    tracers = _tracers(a, trace_dir, torch)
    try:
        for it in range(a.iters):
            for t in tracers:
                t.step_begin(it)
            for vs in range(a.pp * a.vpp):
                p, c = vs % a.pp, vs // a.pp
                chunk, (x, labels), tracer = chunks[p][c], inputs[p][c], tracers[p]
                for m in range(a.microbatches):
                    with tracer.span(spans.FORWARD, chunk=c, microbatch=m):
                        out = chunk(x, labels)
                    with tracer.span(spans.BACKWARD, chunk=c, microbatch=m):
                        if labels is not None:
                            out.float().mean().backward()
                        else:
                            out.backward(grads[p][c])
                    del out
                chunk.zero_grad(set_to_none=False)  # keep the grad buffers: steady-state accumulation
            for t in tracers:
                t.step_end(it)
    finally:
        for t in tracers:
            t.close()
    if torch.device(a.device).type == "cuda":
        torch.cuda.synchronize()
    return set_bytes


def simulate_all(a, cost: CostModel, set_bytes) -> dict:
    """dpp_sim_study's comparison on `cost`, plus per variant the peak in-flight microbatches,
    activation sets and activation bytes per pipeline rank (max over seeds)."""
    peaks: dict = {}

    def record(scen, name, seed, res):
        new = (res.peak_inflight, res.peak_activations, compute_peak_activation_bytes(res.spans, set_bytes, a.pp))
        old = peaks.get((scen, name), new)
        peaks[(scen, name)] = tuple([max(x, y) for x, y in zip(o, n)] for o, n in zip(old, new))

    results = study_config(cost, a.microbatches, a.scenarios, a.seeds, a.traversals, on_result=record)
    for scen, res in results.items():
        for name, row in res["rows"].items():
            if (scen, name) in peaks:
                mb, sets, nbytes = peaks[(scen, name)]
                row.update(
                    peak_inflight_microbatches=mb,
                    peak_activation_sets=sets,
                    peak_activation_MiB=[round(b / 2**20, 1) for b in nbytes],
                )
        del res["runs"]
    return results


def _ms(table) -> list:
    return [[round(t * 1e3, 3) for t in row] for row in table]


def print_report(a, cost: CostModel, set_bytes, results: dict) -> None:
    print(f"{a.preset} on {a.device} ({a.dtype}), PP{a.pp} x V{a.vpp}, M{a.microbatches}, micro-batch {a.micro_batch}")
    print(f"  forward ms [pp][chunk] {_ms(cost.forward_s)}\n  backward ms [pp][chunk] {_ms(cost.backward_s)}")
    print(
        f"  message {cost.message_bytes / 2**20:.2f} MiB: {cost.transfer_s() * 1e6:.1f} us per P2P "
        f"({a.link_GBps} GB/s, {a.latency_us} us); activation set MiB [pp][chunk] "
        f"{[[round(b / 2**20, 1) for b in row] for row in set_bytes]}"
    )
    dpp_sim_study.print_table(
        "ms per iteration, speed vs interleaved/rendezvous (per-seed min..max)",
        {s: {"rows": r["rows"]} for s, r in results.items()},
    )
    print("\npeak in-flight microbatches | activation MiB, per pipeline rank (max over seeds):")
    names = list(next(iter(results.values()))["rows"])
    print("| variant | " + " | ".join(results) + " |\n" + "| --- " * (len(results) + 1) + "|")
    for name in names:
        rows = [res["rows"][name] for res in results.values()]
        if "peak_activation_MiB" in rows[0]:
            cells = [f"{r['peak_inflight_microbatches']} \\| {r['peak_activation_MiB']}" for r in rows]
            print(f"| {name} | " + " | ".join(cells) + " |")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--preset", default="1.3b")
    p.add_argument("--num-layers", type=int, default=0, help="override the preset's (0: keep)")
    p.add_argument("--seq-length", type=int, default=0, help="override the preset's (0: keep)")
    p.add_argument("--vocab-size", type=int, default=0, help="override the preset's (0: keep)")
    p.add_argument("--dtype", choices=list(DTYPE_BYTES), default=None, help="default: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--pp", type=int, default=4)
    p.add_argument("--vpp", type=int, default=2)
    p.add_argument("-m", "--microbatches", type=int, default=8)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--iters", type=int, default=4, help="timing passes; the first is warm-up (untraced)")
    p.add_argument("--link-GBps", type=float, default=350.0, help="effective P2P bandwidth (NVLink 4: ~350)")
    p.add_argument("--latency-us", type=float, default=10.0, help="per message")
    p.add_argument("--seeds", type=int, default=20)
    p.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=list(SCENARIOS))
    p.add_argument("--traversals", nargs="+", default=["depth-first", "breadth-first", "adaptive", "in-order"])
    p.add_argument("--out", default=None, help="directory for dpp_gpu_sim.json (and the trace, with --keep-trace)")
    p.add_argument("--keep-trace", action="store_true")
    return p


def parse_args(argv):
    p = build_parser()
    a = p.parse_args(argv)
    a.dtype = a.dtype or ("bf16" if a.device.startswith("cuda") else "fp32")
    if a.pp < 3 or a.vpp < 1 or a.microbatches % a.pp:
        p.error("needs --pp >= 3 (the scenarios perturb stages 1 and 2), --vpp >= 1 and -m divisible by --pp")
    if a.iters < 2 or a.seeds < 1 or a.micro_batch < 1:
        p.error("needs --iters >= 2 (one warm-up), --seeds >= 1 and --micro-batch >= 1")
    if a.keep_trace and not a.out:
        p.error("--keep-trace needs --out")
    return a


def _check_setup(a, torch) -> str | None:
    """One line saying why this run cannot start, or None."""
    from megatronapp.config import ConfigError, model_preset

    if a.device.startswith("cuda") and not torch.cuda.is_available():
        return f"--device {a.device} but CUDA is not available (use --device cpu with a small preset)"
    try:
        cfg = model_preset(a.preset, **({"num_layers": a.num_layers} if a.num_layers else {}))
    except ConfigError as exc:
        return str(exc)
    if cfg.num_layers % (a.pp * a.vpp):
        return f"{cfg.num_layers} layers do not split into PP {a.pp} x V {a.vpp} chunks (set --num-layers)"
    return None


def main(argv=None) -> int:
    a = parse_args(argv)
    import torch

    from megatronapp.dpp.sim import trace_costs

    why = _check_setup(a, torch)
    if why:
        print(f"dpp_gpu_sim: error: {why}", file=sys.stderr)
        return 2
    t0 = time.time()
    cfg, chunks, dtype = build_chunks(a, torch)
    with tempfile.TemporaryDirectory(prefix="dpp_gpu_sim_") as tmp:
        trace_dir = os.path.join(a.out, "trace") if a.keep_trace else tmp
        set_bytes = trace_task_times(a, cfg, chunks, dtype, trace_dir, torch)
        traced = trace_costs.compute_trace_costs(trace_costs.load_traced_run(trace_dir))
    message = compute_message_bytes(a.micro_batch, cfg.seq_length, cfg.hidden_size, a.dtype)
    cost = compute_link_cost(traced, message, a.link_GBps, a.latency_us)
    results = simulate_all(a, cost, set_bytes)
    print_report(a, cost, set_bytes, results)
    caps = compute_default_caps(a.pp, a.vpp, a.microbatches)
    print(f"\n{time.time() - t0:.0f} s; dynamic caps {caps} activation sets")
    if a.out:
        device = torch.cuda.get_device_name() if a.device.startswith("cuda") else "cpu"
        write_json(a, device, cost, set_bytes, results)
    return 0


def write_json(a, device: str, cost: CostModel, set_bytes, results: dict) -> None:
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, "dpp_gpu_sim.json")
    doc = {
        "args": vars(a),
        "device": device,
        "forward_s": cost.forward_s,
        "backward_s": cost.backward_s,
        "message_bytes": cost.message_bytes,
        "transfer_s": cost.transfer_s(),
        "activation_set_bytes": set_bytes,
        "results": results,
    }
    with open(path + ".tmp", "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(path + ".tmp", path)
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
