"""benchmarks/fa4_registry.py: torch's FA4 registration gets exactly the values it unpacks from
any flash-attn-4 release (the probe's FA4-behind-SDPA variant failed on the H200 without it)."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import fa4_registry  # noqa: E402


@pytest.mark.parametrize("extra", [0, 2, 3], ids=["b19", "b20", "b36"])
def test_fa4_entry_points_keep_the_values_torchs_registration_unpacks(monkeypatch, extra):
    """flash-attn-4 releases after 4.0.0b19 return more than (out, lse) from the forward; torch
    2.11 unpacks two. The adapter torch's registration imports gives it exactly its contract."""
    from torch.nn.attention._fa4 import _fa4_import_module

    out, lse, dq, dk, dv = (torch.full((1,), float(i)) for i in range(5))
    pkg = types.ModuleType("flash_attn.cute.interface")
    pkg._flash_attn_fwd = lambda *a, **k: (out, lse) + (None,) * extra
    pkg._flash_attn_bwd = lambda *a, **k: (dq, dk, dv) + (None,) * (extra > 2)
    cute = types.ModuleType("flash_attn.cute")
    cute.interface = pkg
    monkeypatch.setitem(sys.modules, "flash_attn", types.ModuleType("flash_attn"))
    monkeypatch.setitem(sys.modules, "flash_attn.cute", cute)
    monkeypatch.setitem(sys.modules, "flash_attn.cute.interface", pkg)

    module = _fa4_import_module(fa4_registry.__name__)  # torch's own check of the module
    before = fa4_registry.forward_calls()
    got_out, got_lse = module._flash_attn_fwd(None, None, None, return_lse=True)
    assert (got_out, got_lse) == (out, lse)
    assert module._flash_attn_bwd(None, None, None, None, None, None) == (dq, dk, dv)
    assert fa4_registry.forward_calls() == before + 1
