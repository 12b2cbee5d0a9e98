"""Ctrl-C stops `megatronapp scope serve`: exit code 0, one closing line, no traceback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys


def test_ctrl_c_stops_the_server(tiny_checkpoint):
    cmd = [sys.executable, "-m", "megatronapp.cli.main", "scope", "serve", "--load", tiny_checkpoint]
    proc = subprocess.Popen(
        [*cmd, "--device", "cpu", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # as at a terminal
    )
    try:
        first = proc.stdout.readline()
        assert "MegaScope UI" in first and "Ctrl-C stops it" in first, first + proc.stderr.read()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert out.strip() == "MegaScope UI stopped"
    assert "Traceback" not in err
