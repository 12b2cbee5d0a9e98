"""Every parallel layout trains the same numbers as one process (fp32, CPU, gloo)."""

from __future__ import annotations

import pytest
import torch
from engine_jobs import assemble_full_grads, make_job, train_and_report

LAYOUTS = {
    # name: (world, tp, pp, vpp, schedule)
    "tp2": (2, 2, 1, 1, "1f1b"),
    "pp2_1f1b": (2, 1, 2, 1, "1f1b"),
    "pp2_gpipe": (2, 1, 2, 1, "gpipe"),
    "pp2_vpp2_interleaved": (2, 1, 2, 2, "interleaved"),
    "dp2": (2, 1, 1, 1, "1f1b"),
    "tp2_pp2_dp2": (8, 2, 2, 1, "1f1b"),
    "pp4_1f1b": (4, 1, 4, 1, "1f1b"),
}


@pytest.fixture(scope="module")
def reference():
    torch.set_num_threads(1)
    return train_and_report(0, 1, make_job(1))


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_single_process(cluster, reference, name):
    world, tp, pp, vpp, schedule = LAYOUTS[name]
    job = make_job(world, tp, pp, vpp, schedule)
    reports = cluster.run(train_and_report, world, job)
    for rep in reports:  # every rank knows the loss
        torch.testing.assert_close(rep["losses"], reference["losses"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(rep["norms"], reference["norms"], rtol=1e-5, atol=1e-6)
    # Loss must actually move, otherwise matching it proves little.
    assert abs(reference["losses"][-1] - reference["losses"][0]) > 1e-3
    grads = assemble_full_grads(reports)
    assert grads.keys() == reference["grads"].keys()
    ref = {k: v[0] for k, v in reference["grads"].items()}
    for key, g in grads.items():
        torch.testing.assert_close(g, ref[key], rtol=1e-4, atol=1e-6, msg=lambda m: f"{key}: {m}")
