"""The master-AdamW Triton kernel's logic on CPU, through Triton's interpreter (the GPU tests in
test_mixed_precision.py check it compiled). Needs Triton importable: .ci/run installs it into
.ci/triton (outside the environment, so nothing else sees it); skipped where it is absent."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TRITON_DIR = ROOT / ".ci" / "triton"


def _triton_path() -> str | None:
    if importlib.util.find_spec("triton") is not None:
        return ""
    return str(TRITON_DIR) if (TRITON_DIR / "triton").is_dir() else None


def test_master_adamw_kernel_equals_torch_adamw_in_the_interpreter():
    path = _triton_path()
    if path is None:
        pytest.skip("triton is not installed (.ci/run puts it in .ci/triton)")
    env = {
        **os.environ,
        "TRITON_INTERPRET": "1",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(p for p in (path, str(ROOT), os.environ.get("PYTHONPATH", "")) if p),
    }
    done = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "support" / "master_adam_interpreted.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert done.stdout.count("max |kernel - torch|") == 4, done.stdout
    assert "skip flag: nothing written" in done.stdout, done.stdout
    assert "remainders: masters equal the fp32-master kernel's bit for bit" in done.stdout, done.stdout
