"""The master-AdamW kernel's speed over its launch shape, on the 1.3B preset's parameter shapes.

    python benchmarks/master_adam_sweep.py --out master_adam_sweep.json     # one GPU

One multi-tensor launch per param group (engine/master_adam.py) over fp32 masters, grads and
Adam state and bf16 model weights shaped like the `1.3b` preset's parameters (1.41e9 elements,
30 bytes each per step). Every (elements per program, warps) pair is timed with CUDA events,
rounds interleaved over the pairs; median and range per pair, and the bandwidth it reaches.
First, each pair's one step from the same state is checked against torch's fused AdamW followed
by the bf16 copy (max |difference| of the masters, and how many elements the kernel left unchanged):
a bandwidth above the memory's can only mean skipped work.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
from pathlib import Path

import torch

from megatronapp.config import model_preset
from megatronapp.engine.master_adam import MasterAdamW

BYTES_PER_ELEMENT = 30  # reads main, grad, exp_avg, exp_avg_sq (16); writes main, m, v, bf16 model (14)


def preset_shapes(name: str) -> list[tuple[int, ...]]:
    m = model_preset(name, vocab_size=50304)
    h, f = m.hidden_size, m.ffn_size
    layer = [(3 * h, h), (3 * h,), (h, h), (h,), (f, h), (f,), (h, f), (h,), (h,), (h,), (h,), (h,)]
    return [(m.padded_vocab_size, h)] + layer * m.num_layers + [(h,), (h,), (m.padded_vocab_size, h)]  # untied output


def build(shapes, device) -> tuple[torch.optim.AdamW, dict]:
    mains = [torch.randn(s, device=device) * 0.02 for s in shapes]
    for p in mains:
        p.grad = torch.randn_like(p) * 1e-3
    models = {id(p): p.to(torch.bfloat16) for p in mains}
    groups = [{"params": [p for p in mains if p.ndim >= 2], "weight_decay": 0.1},
              {"params": [p for p in mains if p.ndim < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=1e-4, fused=True), models


def check_one_step(kernel: MasterAdamW, optimizer: torch.optim.AdamW, models: dict, scale) -> dict:
    """One kernel step against torch's AdamW on copies of the same masters and state."""
    mains = [p for g in optimizer.param_groups for p in g["params"]]
    kernel.step(scale)  # compiles, builds the tables, creates the state
    saved = [(p.clone(), {k: v.clone() for k, v in optimizer.state[p].items()}) for p in mains]
    ref = []
    for p, (value, state) in zip(mains, saved):  # torch's AdamW, one tensor at a time (memory)
        q = value.clone()
        q.grad = p.grad
        opt = torch.optim.AdamW([q], lr=optimizer.param_groups[0]["lr"], fused=True,
                                weight_decay=0.1 if p.ndim >= 2 else 0.0)
        opt.state[q] = {k: v.clone() for k, v in state.items()}
        opt.step()
        ref.append(q.detach())
    kernel.step(scale)
    diff = max(float((p - r).abs().max()) for p, r in zip(mains, ref))
    unchanged = sum(int((p == v).sum()) for p, (v, _) in zip(mains, saved))
    bf16_mismatch = sum(int((models[id(p)] != p.to(torch.bfloat16)).sum()) for p in mains)
    for p, (value, state) in zip(mains, saved):  # back to where it was
        p.copy_(value)
        for k, v in state.items():
            optimizer.state[p][k].copy_(v)
    return {"max_abs_diff": diff, "unchanged": unchanged, "bf16_mismatch": bf16_mismatch}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="1.3b")
    p.add_argument("--blocks", default="1024,2048,4096,8192")
    p.add_argument("--warps", default="4,8,16")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    device = torch.device("cuda")
    shapes = preset_shapes(args.preset)
    optimizer, models = build(shapes, device)
    elements = sum(t.numel() for g in optimizer.param_groups for t in g["params"])
    scale = torch.tensor(1.0, device=device)
    kernels = {(b, w): MasterAdamW(optimizer, models, block=b, num_warps=w)
               for b, w in itertools.product(map(int, args.blocks.split(",")), map(int, args.warps.split(",")))}
    checks = {key: check_one_step(k, optimizer, models, scale) for key, k in kernels.items()}
    for key, c in checks.items():
        print(f"check block {key[0]} warps {key[1]}: {c}", flush=True)
    times = {key: [] for key in kernels}
    for _ in range(args.rounds):
        for key, k in kernels.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            k.step(scale)
            end.record()
            end.synchronize()
            times[key].append(start.elapsed_time(end))
    rows = []
    for (b, w), ts in sorted(times.items(), key=lambda kv: statistics.median(kv[1])):
        med = statistics.median(ts)
        rows.append({"block": b, "warps": w, "ms": med, "min_ms": min(ts), "max_ms": max(ts),
                     "tb_per_s": elements * BYTES_PER_ELEMENT / med / 1e9, **checks[(b, w)]})
        print(f"block {b:5d} warps {w:2d}: {med:6.2f} ms ({min(ts):.2f}..{max(ts):.2f}), "
              f"{rows[-1]['tb_per_s']:.2f} TB/s", flush=True)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "elements": elements,
              "rounds": args.rounds, "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
