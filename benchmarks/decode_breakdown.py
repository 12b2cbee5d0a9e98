"""Where a decode step's time goes: GPU time of the replayed decode graph vs wall time per step
of `generate()`, for capture off, the default MegaScope capture, the UI's captures (also with
their host copies queued behind the step on the current stream, as before they moved to a side
stream), and the UI's model thread (ui_runner: captures plus its per-token work, no server).

If wall per step >> GPU per replay, decode is bound by the host (Python between replays and
the per-step sync), and anything the host adds per step (capture bookkeeping, the UI's
streaming) shows in full; if they are close, only added GPU work counts.

    python benchmarks/decode_breakdown.py --model 1.3b --bf16 --out decode_breakdown.json   # GPU
    python benchmarks/decode_breakdown.py --model tiny --device cpu --new-tokens 8           # CPU smoke (no graphs)

Per variant: decode wall ms/step (median over --rounds generations, interleaved), GPU ms per
replay of that variant's decode graph (--replays back-to-back replays between two syncs,
median over rounds), and the kernels of one replay by total time (torch.profiler).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time

import torch

from megatronapp.config import model_preset
from megatronapp.data.tokenizer import load_tokenizer
from megatronapp.inference.generate import SamplingConfig, generate
from megatronapp.inference.model import build_inference_model
from megatronapp.parallel.groups import single_process_groups
from megatronapp.scope import staging
from megatronapp.scope.capture import capture
from megatronapp.scope.compress import DEFAULT_COMPRESS
from megatronapp.scope.sites import DEFAULT_SITES
from megatronapp.scope_ui.protocol import Limits
from megatronapp.scope_ui.runner import GenerationRunner, stream_captures


def variant_contexts(model):
    """name -> factory of the capture contexts that variant runs under (ui_runner: the UI's
    model thread, GenerationRunner.run, which enters its own)."""
    return {
        "off": lambda: [],
        "default_capture": lambda: [capture(model, DEFAULT_SITES, compress=DEFAULT_COMPRESS)],
        "ui_captures": lambda: list(stream_captures(model, (0,), True, 1 << 34)),
        "ui_captures_copies_inline": lambda: [copies_on_current_stream(), *stream_captures(model, (0,), True, 1 << 34)],
        "ui_runner": lambda: [],
    }


@contextlib.contextmanager
def copies_on_current_stream():
    """The captures' device->host copies queued behind the step on the current stream (as before
    2026-12-04) instead of on a side stream: the A/B of scope.staging.SIDE_STREAM_COPIES."""
    staging.SIDE_STREAM_COPIES = False
    try:
        yield
    finally:
        staging.SIDE_STREAM_COPIES = True


def runner_decode_ms_per_step(runner, prompt, new_tokens: int) -> float:
    """Decode ms/step of the UI's model thread (captures, token tap, records for the server)
    with no server: its records go nowhere. generate()'s own timing, read from its result."""
    from megatronapp.scope_ui import protocol as P
    from megatronapp.scope_ui import runner as runner_mod

    results, real = [], runner_mod.generate

    def timed(*args, **kwargs):
        results.append(real(*args, **kwargs))
        return results[-1]

    class NoSink:
        def post(self, items) -> None:
            pass

    runner.check = lambda msg: list(prompt)  # the benchmark's prompt ids, not a tokenised text
    runner_mod.generate = timed
    try:
        runner.run(P.Generate(type="generate", prompt="x", max_new_tokens=new_tokens, stop_on_eod=False), NoSink(), [0])
    finally:
        runner_mod.generate = real
    return 1e3 * results[0].decode_s / max(results[0].decode_steps, 1)


def decode_ms_per_step(model, prompt, new_tokens: int) -> float:
    res = generate(
        model,
        [prompt],
        SamplingConfig(max_new_tokens=new_tokens, stop_on_eod=False),
        eod_id=0,
        vocab_size=model.cfg.vocab_size,
    )
    return 1e3 * res.decode_s / max(res.decode_steps, 1)


def replay_ms(model, replays: int) -> float | None:
    """GPU ms per replay of the decode graph the last generation used (None: no graph)."""
    graph = getattr(model, "_graph", None)
    if graph is None:
        return None
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(replays):
        graph.graph.replay()
    torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - t0) / replays


def replay_kernels(model, top: int = 25) -> list:
    from torch.profiler import ProfilerActivity, profile

    graph = getattr(model, "_graph", None)
    if graph is None:
        return []
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            graph.graph.replay()
        torch.cuda.synchronize()
    rows = [
        (e.device_time_total / 10, e.count // 10, e.key[:100]) for e in prof.key_averages() if e.device_time_total > 0
    ]
    rows.sort(reverse=True)
    return [{"us_per_replay": round(t, 2), "launches": c, "kernel": k} for t, c, k in rows[:top]]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="1.3b")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--replays", type=int, default=200)
    p.add_argument("--out", default=None)
    return p


def main() -> None:
    p = build_parser()
    args = p.parse_args()
    device = torch.device(args.device)
    cfg = model_preset(args.model, vocab_size=50304, seq_length=max(128, args.new_tokens + 40))
    model = build_inference_model(
        cfg, single_process_groups(), device, dtype=torch.bfloat16 if args.bf16 else torch.float32
    )
    model.cuda_graphs = device.type == "cuda"
    tok = load_tokenizer(None)  # the runner's: ids below its vocabulary
    prompt = torch.randint(0, tok.vocab_size, (32,), generator=torch.Generator().manual_seed(0)).tolist()
    variants = variant_contexts(model)
    runner = GenerationRunner(model, tok, Limits(max_new_tokens=max(256, args.new_tokens), max_capture_bytes=1 << 34))
    wall = {k: [] for k in variants}
    gpu = {k: [] for k in variants}
    kernels = {}
    for r in range(args.rounds + 1):  # round 0 warms up (captures each variant's graph)
        for name, make in variants.items():
            with contextlib.ExitStack() as stack:
                for c in make():
                    stack.enter_context(c)
                ms = (
                    runner_decode_ms_per_step(runner, prompt, args.new_tokens)
                    if name == "ui_runner"
                    else decode_ms_per_step(model, prompt, args.new_tokens)
                )
                rep = replay_ms(model, args.replays) if device.type == "cuda" else None
                if r == 0 and device.type == "cuda":
                    kernels[name] = replay_kernels(model)
            if r > 0:
                wall[name].append(ms)
                if rep is not None:
                    gpu[name].append(rep)
        print(f"round {r}: " + ", ".join(f"{k} {wall[k][-1] if wall[k] else 0:.3f} ms" for k in variants), flush=True)
    report = {"model": args.model, "device": str(device), "new_tokens": args.new_tokens}
    for name in variants:
        w = statistics.median(wall[name])
        g = statistics.median(gpu[name]) if gpu[name] else None
        report[name] = {
            "wall_ms_per_step": w,
            "wall_range": [min(wall[name]), max(wall[name])],
            "gpu_ms_per_replay": g,
            "host_bound_ms": None if g is None else w - g,
            "kernels": kernels.get(name, []),
        }
    print(
        json.dumps(
            {
                k: {kk: vv for kk, vv in v.items() if kk != "kernels"} if isinstance(v, dict) else v
                for k, v in report.items()
            },
            indent=1,
        )
    )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
