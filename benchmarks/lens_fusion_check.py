"""Would fusing the logit lens into the output head keep the model's logits bit for bit, and what
would it save? One device call answers both before anyone changes the head.

    python benchmarks/lens_fusion_check.py --device cuda --bf16          # H200: 1.3B head shapes
    python benchmarks/lens_fusion_check.py --device cpu --vocab 4096      # CPU smoke

Today a decode step with the logit lens reads the output embedding (V x H) twice: the head's
matmul over the B newest hidden states (M = B rows) and the lens's over the L layers' residuals
(M = L*B). Fused, one matmul over the stacked (L+1)*B rows reads it once and the head's logits
are its last B rows. That is only safe if a row of a matmul does not depend on how many rows
the matmul has: the kernel (GEMV for M = 1, a tiled GEMM for more; split-K or not) is chosen by
the shape, and another kernel may sum the H products in another order, which can move a bf16
logit by one unit in the last place and flip a greedy token (the UI must give the same tokens as
`megatronapp generate`; a GPU test asserts capture-on logits are bitwise capture-off's).

Reports: the fraction of trials (random hidden states) whose head row differs at all between
M = B and M = (L+1)*B, the largest difference, and the median time (CUDA events, back to back)
of head + lens (two matmuls) vs the fused one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F
from megatronapp.files import write_text_atomic


def time_ms(fn, device, reps: int) -> float:
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        fn()
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / reps
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return 1e3 * (time.perf_counter() - t0) / reps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--trials", type=int, default=200)
    p.add_argument("--reps", type=int, default=200)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    device, dtype = torch.device(args.device), torch.bfloat16 if args.bf16 else torch.float32
    g = torch.Generator(device=device).manual_seed(0)
    weight = (0.02 * torch.randn(args.vocab, args.hidden, generator=g, device=device)).to(dtype)
    b, rows = args.batch, (args.layers + 1) * args.batch
    differing, worst = 0, 0.0
    for _ in range(args.trials):
        x = torch.randn(rows, args.hidden, generator=g, device=device).to(dtype)
        alone, fused = F.linear(x[-b:], weight), F.linear(x, weight)[-b:]
        if not torch.equal(alone, fused):
            differing += 1
            worst = max(worst, float((alone.float() - fused.float()).abs().max()))
    x = torch.randn(rows, args.hidden, generator=g, device=device).to(dtype)
    head, lens = x[-b:].contiguous(), x[:-b].contiguous()
    two, one = [], []
    for _ in range(args.rounds):  # interleaved
        two.append(time_ms(lambda: (F.linear(head, weight), F.linear(lens, weight)), device, args.reps))
        one.append(time_ms(lambda: F.linear(x, weight), device, args.reps))
    report = {"device": str(device), "dtype": str(dtype), "shape": [args.vocab, args.hidden], "rows": rows,
              "trials": args.trials, "trials_with_a_differing_head_row": differing, "largest_difference": worst,
              "head_plus_lens_ms": statistics.median(two), "fused_ms": statistics.median(one),
              "saved_us_per_step": 1e3 * (statistics.median(two) - statistics.median(one))}
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        write_text_atomic(args.out, text)


if __name__ == "__main__":
    main()
