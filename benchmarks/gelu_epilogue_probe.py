"""Probe (GPU): does cuBLASLt's GELU epilogue pair buy the engine's MLP time? (issue 8)

The engine's MLP is fc1 -> tanh-GELU -> fc2 (model/gpt.py). Compiled, the GELU runs as Triton
kernels beside cuBLAS GEMMs: forward reads fc1's output and writes the activation; backward
reads the activation's gradient and the pre-activation and writes the pre-activation's
gradient, and the fc1 bias gradient is one more pass over it. cuBLASLt can do that work in the
GEMMs' epilogues (Transformer Engine does, for Megatron's MLP):
  forward   fc1 with GELU_AUX_BIAS: writes GELU(x W1^T + b1) and, beside it, the pre-activation
            (the "aux" the backward needs);
  backward  fc2's input-gradient GEMM with DGELU_BGRAD: writes dL/dpre = (dL/dy W2) * GELU'(aux)
            and the fc1 bias gradient (sum over tokens) in the same kernel.
torch does not expose those epilogues for training, nvmath-python (NVIDIA's Python binding of
cuBLASLt, a well-kept library) does. This probe times one MLP forward+backward at the 1.3B
preset's shapes both ways (the torch one compiled, as the engine's blocks are), interleaved, and
checks the epilogue path's outputs and gradients against the torch path first.

cuBLASLt puts the bias along the result's rows and wants the aux column-major, so the epilogue
GEMMs are written transposed: act^T (F, T) = W1 (F, H) @ x^T (H, T), a column-major (F, T) is
a row-major (T, F), and the backward's dpre^T = W2^T (F, H) @ dy^T (H, T) reads that same aux.

    pip install --no-deps .whl/nvmath_python-1.0.1-cp312-cp312-manylinux_2_28_x86_64.whl
    PYTHONPATH=. python benchmarks/gelu_epilogue_probe.py [--reps 30] [--out probe.json]

Needs CUDA, and nvmath-python with the device's cuda-bindings / cuda-core / cuda-pathfinder.
Measured on the H200 (2026-12-04, BENCHMARKS.md): 3.07 ms against the compiled MLP's 2.64, so
the engine's --gelu-epilogue-fusion (session 13) was removed; this probe stays to judge it again.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from cuda_timing import add_timing_arguments, cuda_event_times, summary


def torch_mlp(x, w1, b1, w2, b2):
    return F.linear(F.gelu(F.linear(x, w1, b1), approximate="tanh"), w2, b2)


class EpilogueMLP:
    """fc1 + GELU + fc2 with the GELU in cuBLASLt epilogues (nvmath stateful Matmul objects,
    planned once for the shapes, operands reset per call)."""

    def __init__(self, x, w1, b1, w2, b2):
        from nvmath.linalg.advanced import Matmul, MatmulEpilog

        self.stream = torch.cuda.current_stream()
        t = x.shape[0]
        self.fwd = Matmul(w1, x.t(), stream=self.stream)  # (F, H) @ (H, T)
        self.fwd.plan(epilog=MatmulEpilog.GELU_AUX_BIAS, epilog_inputs={"bias": b1}, stream=self.stream)
        dy = torch.empty(t, w2.shape[0], dtype=x.dtype, device=x.device)
        _, aux = self.fwd.execute(stream=self.stream)  # one run to get the aux output's name and layout
        self.aux_name = next(iter(aux))
        self.bwd = Matmul(w2.t(), dy.t(), stream=self.stream)  # (F, H) @ (H, T)
        self.bwd.plan(epilog=MatmulEpilog.DGELU_BGRAD, epilog_inputs={self.aux_name: aux[self.aux_name]},
                      stream=self.stream)

    def forward(self, x, w1, b1, w2, b2):
        self.fwd.reset_operands(a=w1, b=x.t(), epilog_inputs={"bias": b1}, stream=self.stream)
        act_t, aux = self.fwd.execute(stream=self.stream)
        act = act_t.t()  # (T, F), row-major
        return F.linear(act, w2, b2), (x, act, aux[self.aux_name])

    def backward(self, dy, saved, w1, w2):
        x, act, aux = saved
        gw2, gb2 = dy.t() @ act, dy.sum(0)
        self.bwd.reset_operands(a=w2.t(), b=dy.t(), epilog_inputs={self.aux_name: aux}, stream=self.stream)
        dpre_t, out = self.bwd.execute(stream=self.stream)
        gb1 = next(iter(out.values())).reshape(-1)
        gw1, gx = dpre_t @ x, dpre_t.t() @ w1
        return gx, gw1, gb1, gw2, gb2


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=8192, help="micro-batch 4 x seq 2048")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--ffn", type=int, default=8192)
    add_timing_arguments(p, reps=30)
    a = p.parse_args()
    if not torch.cuda.is_available():
        p.error("needs CUDA")
    torch.manual_seed(0)
    dev, dt = torch.device("cuda"), torch.bfloat16
    x = torch.randn(a.tokens, a.hidden, device=dev, dtype=dt)
    w1 = (torch.randn(a.ffn, a.hidden, device=dev) * 0.02).to(dt)
    b1 = (torch.randn(a.ffn, device=dev) * 0.02).to(dt)
    w2 = (torch.randn(a.hidden, a.ffn, device=dev) * 0.02).to(dt)
    b2 = (torch.randn(a.hidden, device=dev) * 0.02).to(dt)
    dy = torch.randn(a.tokens, a.hidden, device=dev, dtype=dt)

    leaves = [t.clone().requires_grad_() for t in (x, w1, b1, w2, b2)]
    compiled = torch.compile(torch_mlp)

    def torch_step():
        for t in leaves:
            t.grad = None
        compiled(*leaves).backward(dy)
        return [t.grad for t in leaves]

    ref_y = compiled(*leaves).detach()
    ref_grads = torch_step()
    epi = EpilogueMLP(x, w1, b1, w2, b2)

    def epi_step():
        y, saved = epi.forward(x, w1, b1, w2, b2)
        return y, epi.backward(dy, saved, w1, w2)

    y, grads = epi_step()
    check = {"y": (y, ref_y)} | {n: (g, r) for n, g, r in zip(("x", "w1", "b1", "w2", "b2"), grads, ref_grads)}
    errors = {n: ((g.float() - r.float()).abs().max() / r.float().abs().max().clamp_min(1e-12)).item()
              for n, (g, r) in check.items()}
    print("max |epilogue - torch| / max |torch|: " + ", ".join(f"{n} {e:.2e}" for n, e in errors.items()), flush=True)

    for _ in range(3):
        torch_step(), epi_step()
    times = {"torch_compiled": [], "cublaslt_epilogues": []}
    for _ in range(a.rounds):  # interleaved rounds: drift hits both alike
        times["torch_compiled"] += cuda_event_times(torch_step, a.reps)
        times["cublaslt_epilogues"] += cuda_event_times(epi_step, a.reps)
    out = {"shapes": vars(a), "relative_error": errors, "device": torch.cuda.get_device_name(), "torch": torch.__version__}
    for name, ts in times.items():
        out[name] = summary(ts)
        print(f"{name:20s} {out[name]['median_ms']:.3f} ms per MLP forward+backward (min {min(ts):.3f}, "
              f"max {max(ts):.3f}, n {len(ts)})", flush=True)
    saved = out["torch_compiled"]["median_ms"] - out["cublaslt_epilogues"]["median_ms"]
    print(f"epilogues save {saved:.3f} ms per MLP call; x48 (24 layers x 2 microbatches) = {48 * saved:.1f} ms a step")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
