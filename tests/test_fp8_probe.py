"""benchmarks/fp8_probe.py on the CPU: every case it would time runs and computes an FP8
linear (behind its producer or alone) within the formats' error of bf16; timing is the GPU's."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import fp8_probe  # noqa: E402


def test_every_case_computes_the_linear_within_fp8_error():
    torch.set_num_threads(1)
    errors = fp8_probe.check(torch.device("cpu"))
    assert len(errors) == 4 * 2 * 2  # linears x (alone, producer) x FP8 recipes
    for key, err in errors.items():
        assert 1e-3 < err < 0.1, (key, err)  # FP8 ran (not bf16's numbers), and within its rounding
    for key, err in errors.items():  # a delayed state fitted to the operands casts as current scaling
        if "/delayed/" in key:
            assert err == errors[key.replace("/delayed/", "/tensorwise/")], key


def test_a_compiled_case_is_as_close_to_bf16_as_the_eager_one():
    """Compiled, the GELU is computed in fp32 and rounded once, eager in bf16: a few inputs land
    one FP8 step apart, so the two are compared by their error against bf16, not elementwise."""
    torch.set_num_threads(1)
    x, w, g = fp8_probe._operands(32, 64, 16, "cpu")
    ref = fp8_probe.build_case("bf16", "gelu", x, w, g, compiled=False)()
    for compiled in (False, True):
        got = fp8_probe.build_case("delayed", "gelu", x, w, g, compiled=compiled)()
        for a, b in zip(got, ref):
            assert 1e-3 < ((a.float() - b.float()).norm() / b.float().norm()).item() < 0.1


def test_every_timed_case_is_compiled_past_dynamos_recompile_limit(monkeypatch):
    """Twelve cases share build_case's code object, more than dynamo's default limit of 8
    recompiles: each still gets its own compiled frame (without the raised limit, 9 frames)."""
    torch.set_num_threads(1)
    torch._dynamo.reset()
    monkeypatch.setattr(fp8_probe, "LINEARS", fp8_probe.LINEARS[:2])
    cases = fp8_probe.build_cases(16, "cpu", scale_down=128)
    assert len(cases) == 12 > torch._dynamo.config.recompile_limit
    assert fp8_probe.warm_up(cases, steps=1) == 12
