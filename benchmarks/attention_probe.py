"""Probe (GPU): which attention kernel is fastest for the engine's 1.3B shapes? (issue 8)

Attention is ~33 ms of the engine's ~270 ms step on the H200 (BENCHMARKS.md, kernel time by
kind), i.e. ~300 TFLOP/s for causal forward+backward, while FlashAttention-3-class Hopper
kernels are reported well above that. torch >= 2.10 can swap the kernels behind SDPA's flash
backend for FlashAttention-4's CuTe-DSL ones (`torch.nn.attention.activate_flash_attention_impl
("FA4")`, SM 9.0 and 10.0; fa4_registry.py adapts newer flash-attn-4 releases to it). Measured
on the H200 (2026-12-04): cuDNN's kernel, torch's own choice, is the fastest here. This probe
times one causal attention forward+backward at the engine's shapes, with q, k, v laid out as
the engine makes them (transposed views of (B, S, heads, D)), for each kernel available:

  auto        SDPA with torch's own choice (what the plain model and the engine get today)
  cudnn       SDPA, cuDNN backend first
  flash       SDPA, flash backend (FlashAttention-2 inside torch)
  fa4_sdpa    SDPA, flash backend with FA4 activated (skipped without flash_attn.cute)
  fa4_direct  flash_attn.cute.flash_attn_func on (B, S, heads, D), no SDPA wrapper

Rounds are interleaved (FA4's activation is process-wide, so it is switched on and off around
its own calls). Each variant's output and gradients are first checked against SDPA's math
backend in fp32, and the kernels each one launches are recorded (torch.profiler), so the
table says what actually ran.

    PYTHONPATH=. python benchmarks/attention_probe.py [--out probe.json]   (FA4's checks: fa4_registry.py)

FA4 on the device host: its wheels travel in two parts (too large for one call's 64 MiB);
see `benchmarks/fa4_wheels.sh`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from cuda_timing import add_timing_arguments, cuda_event_times, summary

import fa4_registry

_SDPA_BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
                  "math": SDPBackend.MATH}


def causal_attention_flops(batch: int, heads: int, seq: int, head_dim: int) -> tuple[float, float]:
    """(forward, backward) FLOPs actually needed by causal attention: QK^T and PV are
    2·S²·D each per head, halved by the mask; the backward does 2.5x the forward's matmuls."""
    fwd = 4.0 * batch * heads * seq * seq * head_dim / 2
    return fwd, 2.5 * fwd


def _sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


@contextlib.contextmanager
def _fa4_active():
    from torch.nn.attention import restore_flash_attention_impl

    fa4_registry.activate()
    try:
        yield
    finally:
        restore_flash_attention_impl()


def _variant_contexts(fa4: bool) -> dict[str, Callable[[], contextlib.AbstractContextManager]]:
    out = {"auto": contextlib.nullcontext,
           "cudnn": lambda: sdpa_kernel(_SDPA_BACKENDS["cudnn"]),
           "flash": lambda: sdpa_kernel(_SDPA_BACKENDS["flash"])}
    if fa4:
        @contextlib.contextmanager
        def fa4_sdpa():
            with _fa4_active(), sdpa_kernel(_SDPA_BACKENDS["flash"]):
                yield
        out["fa4_sdpa"] = fa4_sdpa
    return out


def _kernels(fn) -> list[str]:
    """Names of the CUDA kernels one call launches, longest first."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    rows = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    rows.sort(key=lambda e: -e.device_time_total)
    return [e.key[:120] for e in rows[:4]]


def _rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-12)).item()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--head-dim", type=int, default=128)
    add_timing_arguments(p, reps=20)
    a = p.parse_args()
    if not torch.cuda.is_available():
        p.error("needs CUDA")
    torch.manual_seed(0)
    shape = (a.batch, a.seq, a.heads, a.head_dim)  # the engine's layout before its transpose
    base = [torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    dy = torch.randn(shape, device="cuda", dtype=torch.bfloat16).transpose(1, 2)

    ref_in = [t.float().transpose(1, 2).requires_grad_() for t in base]
    with sdpa_kernel(_SDPA_BACKENDS["math"]):
        ref_out = _sdpa(*ref_in)
    ref_out.backward(dy.float())
    refs = {"out": ref_out.detach()} | {f"d{n}": t.grad for n, t in zip("qkv", ref_in)}

    fa4_missing = fa4_registry.unavailable_reason()
    contexts = _variant_contexts(fa4_missing is None)
    leaves = [t.clone().requires_grad_() for t in base]

    def sdpa_step(ctx):
        def step():
            for t in leaves:
                t.grad = None
            with ctx():
                out = _sdpa(*(t.transpose(1, 2) for t in leaves))
            out.backward(dy)
            return out
        return step

    steps = {name: sdpa_step(ctx) for name, ctx in contexts.items()}
    if fa4_missing is None:
        from flash_attn.cute import flash_attn_func

        def fa4_direct():
            for t in leaves:
                t.grad = None
            out = flash_attn_func(*leaves, causal=True)
            out = out[0] if isinstance(out, tuple) else out
            out.backward(dy.transpose(1, 2))
            return out.transpose(1, 2)
        steps["fa4_direct"] = fa4_direct
    else:
        print(f"fa4 variants skipped: {fa4_missing}", flush=True)

    report = {"shape": vars(a), "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "fa4_skipped": fa4_missing, "variants": {}}
    for name, step in steps.items():
        out = step()
        errors = {"out": _rel_err(out.detach(), refs["out"])}
        errors |= {f"d{n}": _rel_err(t.grad.transpose(1, 2), refs[f"d{n}"]) for n, t in zip("qkv", leaves)}
        report["variants"][name] = {"relative_error_vs_fp32_math": errors, "kernels": _kernels(step)}
        print(f"{name:10s} error " + ", ".join(f"{k} {v:.1e}" for k, v in errors.items())
              + f"; kernels: {report['variants'][name]['kernels'][:2]}", flush=True)

    times = {name: [] for name in steps}
    for _ in range(2):
        for step in steps.values():
            step()
    for _ in range(a.rounds):  # interleaved: drift hits every variant alike
        for name, step in steps.items():
            times[name] += cuda_event_times(step, a.reps)
    fwd, bwd = causal_attention_flops(a.batch, a.heads, a.seq, a.head_dim)
    for name, ts in times.items():
        row = summary(ts)
        med = row["median_ms"]
        row["tflops"] = (fwd + bwd) / (med * 1e-3) / 1e12
        report["variants"][name]["time"] = row
        print(f"{name:10s} {med:.3f} ms forward+backward (min {min(ts):.3f}, max {max(ts):.3f}, n {len(ts)}): "
              f"{row['tflops']:.0f} TFLOP/s; x48 (24 layers x 2 microbatches) = {48 * med:.1f} ms a step", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
