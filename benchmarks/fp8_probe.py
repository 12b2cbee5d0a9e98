"""Probe (GPU): where an FP8 linear's time goes, at the 1.4B model's shapes (issue 8).

The engine's step with `--fp8-format` is one number; this probe splits it. For each of a
transformer layer's four linears (QKV, attention projection, FC1, FC2) at micro-batch 4 x seq
2048 tokens, it times one forward + backward, compiled as the engine's blocks are, of:

  bf16        F.linear (the engine's --bf16 GEMMs);
  tensorwise  parallel/fp8.py's current scaling (amax pass, then cast, then the FP8 GEMMs);
  delayed     parallel/fp8.py's delayed recipe (cast with a known scale, amax recorded).

Each linear is timed twice. First alone, its input a given tensor. Then behind the op that
produces its input in the model: LayerNorm before QKV and FC1, GELU before FC2, and a plain
scale before the projection. With a known scale, the delayed cast can fuse into that producer's
kernel; with current scaling it cannot. So "with producer" minus "alone" is where the recipes
differ. Every timing is a forward and a backward, with CUDA events, the variants interleaved
in rounds. The report gives medians and the per-step projection: x 24 layers x 2 microbatches.

    PYTHONPATH=. python benchmarks/fp8_probe.py [--reps 20] [--rounds 5] [--out fp8_probe.json]

`--check` runs every case once at tiny shapes on any device and compares it with bf16 (the CPU
test does this); timing needs CUDA.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

import torch
import torch.nn.functional as F

from megatronapp.model.gpt import compile_counts
from megatronapp.parallel.fp8 import E5M2, DelayedScaling, FP8Spec, fp8_linear, power_of_two_scale

# (name, in, out, producer of its input) for one layer of the 1.4B model (hidden 2048, ffn 8192)
LINEARS = (("qkv", 2048, 6144, "layernorm"), ("proj", 2048, 2048, "scale"),
           ("fc1", 2048, 8192, "layernorm"), ("fc2", 8192, 2048, "gelu"))
RECIPES = ("bf16", "tensorwise", "delayed")
STEP_MULTIPLIER = 24 * 2  # layers x microbatches of the benchmark's step


def _produce(kind: str, x: torch.Tensor) -> torch.Tensor:
    if kind == "layernorm":
        return F.layer_norm(x, x.shape[-1:])
    if kind == "gelu":
        return F.gelu(x, approximate="tanh")
    return x * 0.5


def _linear(recipe: str, state: DelayedScaling | None) -> Callable:
    if recipe == "bf16":
        return lambda x, w: F.linear(x, w)
    return lambda x, w: fp8_linear(x, w, None, FP8Spec(E5M2), state=state)


def ready_delayed_state(x: torch.Tensor, w: torch.Tensor, g: torch.Tensor) -> DelayedScaling:
    """A delayed state whose scales fit these operands, as after a first step on them."""
    st = DelayedScaling(E5M2, 1, x.device)
    amax = torch.stack([t.detach().abs().amax().float() for t in (x, w, g)])
    st.scale.copy_(power_of_two_scale(amax, st.fmax))
    st.ready = True
    return st


def build_case(recipe: str, producer: str | None, x: torch.Tensor, w: torch.Tensor, g: torch.Tensor,
               compiled: bool = True) -> Callable[[], tuple]:
    """A forward + backward of one linear (behind `producer`, or alone): returns (y, dx, dw)."""
    state = ready_delayed_state(_produce(producer, x) if producer else x, w, g) if recipe == "delayed" else None
    linear = _linear(recipe, state)

    def fwd(a, b):
        return linear(_produce(producer, a) if producer else a, b)

    fn = torch.compile(fwd) if compiled else fwd
    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()

    def step():
        xs.grad = ws.grad = None
        y = fn(xs, ws)
        y.backward(g)
        return y, xs.grad, ws.grad
    return step


def _operands(tokens: int, d_in: int, d_out: int, device, seed: int = 0):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(tokens, d_in, generator=gen).to(device, torch.bfloat16)
    w = (torch.randn(d_out, d_in, generator=gen) * 0.02).to(device, torch.bfloat16)
    g = (torch.randn(tokens, d_out, generator=gen) * 1e-3).to(device, torch.bfloat16)
    return x, w, g


def _linear_cases(tokens: int, device, scale_down: int):
    """(linear name, producer or None, x, w, g) for each linear alone and behind its producer."""
    for name, d_in, d_out, producer in LINEARS:
        x, w, g = _operands(tokens, d_in // scale_down, d_out // scale_down, device)
        for prod in (None, producer):
            yield name, prod, x, w, g


def build_cases(tokens: int, device, scale_down: int = 1) -> dict[str, Callable[[], tuple]]:
    """name/producer/recipe -> a compiled step, for every case the probe times."""
    return {f"{name}/{prod or 'alone'}/{recipe}": build_case(recipe, prod, x, w, g)
            for name, prod, x, w, g in _linear_cases(tokens, device, scale_down) for recipe in RECIPES}


def warm_up(cases: dict[str, Callable[[], tuple]], steps: int = 3) -> int:
    """Compile and warm every case; returns how many compiled. The cases share one code object
    (build_case's `fwd`), so dynamo's recompile limit (8) would leave the later ones eager:
    session 18's first probe timed 16 of its 24 cases that way. The limit is raised to the
    case count, and a case left uncompiled is an error, not a silent eager timing."""
    before = compile_counts()["frames"]
    with torch._dynamo.config.patch(recompile_limit=len(cases) + 8):
        for step in cases.values():
            for _ in range(steps):
                step()
    compiled = compile_counts()["frames"] - before
    if compiled != len(cases):
        raise SystemExit(f"fp8_probe: {compiled} compiled frames for {len(cases)} cases; timings would mix eager and compiled")
    return compiled


def check(device, tokens: int = 32, scale_down: int = 128, compiled: bool = False) -> dict:
    """Every case once at tiny shapes: its relative error against bf16 (y, dx, dw)."""
    errors = {}
    for name, prod, x, w, g in _linear_cases(tokens, device, scale_down):
        ref = build_case("bf16", prod, x, w, g, compiled)()
        for recipe in RECIPES[1:]:
            got = build_case(recipe, prod, x, w, g, compiled)()
            errors[f"{name}/{recipe}/{prod or 'alone'}"] = max(
                ((a.float() - b.float()).norm() / b.float().norm()).item() for a, b in zip(got, ref))
    return errors


def main() -> None:
    from cuda_timing import add_timing_arguments, cuda_event_times, summary

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=8192, help="micro-batch 4 x seq 2048")
    p.add_argument("--check", action="store_true", help="tiny shapes, errors against bf16, no timing")
    add_timing_arguments(p, reps=20)
    a = p.parse_args()
    if a.check:
        dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        for key, err in check(dev).items():
            print(f"{key:32s} {err:.3e}")
        return
    if not torch.cuda.is_available():
        p.error("timing needs CUDA (--check runs anywhere)")
    torch.backends.cuda.matmul.allow_tf32 = True
    cases = build_cases(a.tokens, "cuda")
    print(f"compiled {warm_up(cases)} cases", flush=True)
    times = {key: [] for key in cases}
    for r in range(a.rounds):  # interleaved rounds: drift hits every case alike
        for key, step in cases.items():
            times[key] += cuda_event_times(step, a.reps)
        print(f"round {r + 1}/{a.rounds} done", flush=True)
    out = {"tokens": a.tokens, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "cases": {key: summary(ts) for key, ts in times.items()}}
    print(f"{'case':28s} {'median ms':>10s}   per step (x{STEP_MULTIPLIER})")
    for key, s in out["cases"].items():
        print(f"{key:28s} {s['median_ms']:10.3f}   {STEP_MULTIPLIER * s['median_ms']:8.1f} ms")
    for where in ("alone", "producer"):
        totals = {recipe: sum(out["cases"][f"{n}/{p if where == 'producer' else 'alone'}/{recipe}"]["median_ms"]
                              for n, _, _, p in LINEARS) for recipe in RECIPES}
        out[f"layer_{where}"] = totals
        print(f"one layer's linears, {where}: " + ", ".join(
            f"{r} {STEP_MULTIPLIER * t:.1f} ms/step" for r, t in totals.items()))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
