"""The time budget of a real fault: one rank of an unmodified 2-rank DDP script under `trace run`
sits under a cgroup CPU quota it knows nothing of; its budget shows the time it was descheduled
and throttled, its peer's does not. Skips without root and a cgroup with the cpu controller."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from megatronapp.faultlab import LabPlan, ScriptJob, SlowRank, run_lab
from megatronapp.faultlab.cpu import cgroup_flavour
from megatronapp.scan.analyze.budget_summary import compute_budget_summary
from megatronapp.scan.analyze.load_align_detect import analyze_trace_dir

DDP_SCRIPT = str(Path(__file__).resolve().parents[2] / "examples" / "ddp_train.py")


def test_a_rank_under_a_cpu_quota_is_descheduled_and_throttled_in_its_budget(tmp_path):
    if os.geteuid() != 0 or cgroup_flavour() is None:
        pytest.skip("needs root and a writable cgroup with the cpu controller")
    rank = random.Random().randrange(2)
    plan = LabPlan(
        ScriptJob(DDP_SCRIPT, ("--steps", "8", "--hidden", "1024", "--batch", "128"), nproc=2),
        (SlowRank(rank, "quota", factor=6.0),),  # a sixth of its core: throttled in every iteration
        tag="budq",
    )
    result = run_lab(plan, tmp_path / "trace", timeout_s=110.0)
    assert result.returncode == 0, result.log.read_text()[-3000:]
    analysis = analyze_trace_dir(str(result.trace_dir))
    ranks = {r.rank: r for r in compute_budget_summary(analysis.traces, analysis.detection.iterations_analyzed).ranks}
    slow, peer = ranks[rank], ranks[1 - rank]
    assert slow.measured and peer.measured

    def share(r, part):
        return r.median_ns[part] / r.median_ns["wall"]

    assert share(slow, "descheduled") > share(peer, "descheduled") + 0.1, (slow, peer)
    assert slow.median_ns["throttled"] > 0 and peer.median_ns["throttled"] == 0, (slow, peer)
    assert slow.slow and "descheduled" in slow.cause and not peer.slow, (slow, peer)
