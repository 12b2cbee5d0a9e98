"""benchmarks/dpp_gpu_sim.py: the cost model derived from traced chunk times (link, activation
memory) and a tiny end-to-end run on CPU (the GPU run is the same code on --device cuda)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import dpp_gpu_sim  # noqa: E402

from megatronapp.dpp.config import JitterSpec  # noqa: E402
from megatronapp.dpp.scheduler import compute_default_caps  # noqa: E402
from megatronapp.dpp.simulator import CostModel, Span, simulate  # noqa: E402
from megatronapp.dpp.tasks import backward_task, forward_task  # noqa: E402
from megatronapp.pipeline.schedules import build_schedule  # noqa: E402


def test_message_is_one_microbatch_residual_stream():
    assert dpp_gpu_sim.compute_message_bytes(1, 2048, 2048, "bf16") == 8 * 2**20
    assert dpp_gpu_sim.compute_message_bytes(2, 128, 256, "fp32") == 2 * 128 * 256 * 4


def test_link_cost_adds_latency_and_bytes_over_bandwidth_and_keeps_task_times():
    traced = CostModel(((1e-3, 2e-3),) * 4, ((3e-3, 4e-3),) * 4)
    cost = dpp_gpu_sim.compute_link_cost(traced, 8 * 2**20, bandwidth_GBps=350.0, latency_us=10.0)
    assert cost.transfer_s(1, 2) == pytest.approx(10e-6 + 8 * 2**20 / 350e9)
    assert cost.forward_s == traced.forward_s and cost.backward_s == traced.backward_s
    with pytest.raises(ValueError, match="bandwidth > 0"):
        dpp_gpu_sim.compute_link_cost(traced, 1, bandwidth_GBps=0.0, latency_us=1.0)


@pytest.mark.parametrize("how", ["interleaved", "looped-bfs", "dynamic"])
def test_peak_bytes_with_unit_sets_equal_the_in_flight_counters_peak(how):
    """Two independent accounts of held activations: the span replay (bytes) and the
    schedulers' own counters (sets), under jitter; with 1 byte per set they must agree."""
    pp, v, m = 4, 2, 8
    cost = CostModel.uniform(pp, v, p2p_latency_s=0.3, jitter=(JitterSpec(2, 1.5, 7),))
    kw = (dict(traversal="depth-first", caps=compute_default_caps(pp, v, m)) if how == "dynamic"
          else dict(schedule=build_schedule(how, pp, v, m)))
    res = simulate(pp, v, m, cost, **kw)
    assert dpp_gpu_sim.compute_peak_activation_bytes(res.spans, [[1] * v] * pp, pp) == res.peak_activations


def test_peak_bytes_weigh_sets_by_their_chunk():
    spans = [Span(0, forward_task(0, 0), 0.0, 1.0), Span(0, forward_task(1, 0), 1.0, 2.0),
             Span(0, backward_task(1, 0), 2.0, 3.0), Span(0, forward_task(0, 1), 3.0, 4.0),
             Span(0, backward_task(0, 0), 4.0, 5.0), Span(0, backward_task(0, 1), 5.0, 6.0)]
    assert dpp_gpu_sim.compute_peak_activation_bytes(spans, [[10, 100]], 1) == [110]


def test_cpu_tiny_run_writes_costs_memory_and_ratios(tmp_path):
    code = dpp_gpu_sim.main(["--device", "cpu", "--preset", "tiny", "--num-layers", "8", "-m", "4", "--iters", "3",
                             "--seeds", "2", "--scenarios", "balanced", "jitter1", "--traversals", "in-order",
                             "--out", str(tmp_path), "--keep-trace"])
    assert code == 0
    doc = json.loads((tmp_path / "dpp_gpu_sim.json").read_text())
    assert len(doc["forward_s"]) == 4 and all(len(r) == 2 and min(r) > 0 for r in doc["forward_s"] + doc["backward_s"])
    sets = doc["activation_set_bytes"]
    layers_only = [sets[p][c] for p in range(4) for c in range(2) if (p, c) not in ((0, 0), (3, 1))]
    assert min(layers_only) > 0 and len(set(layers_only)) == 1  # same shape, same saved tensors
    assert sets[3][1] > layers_only[0]  # the head's logits are kept too
    rows = doc["results"]["jitter1"]["rows"]
    assert rows["interleaved/rendezvous"]["speed"] == 1.0
    caps = compute_default_caps(4, 2, 4)
    assert all(0 < p <= c for p, c in zip(rows["dynamic-in-order"]["peak_activation_sets"], caps))
    assert rows["dynamic-in-order"]["peak_activation_MiB"] == rows["interleaved/eager"]["peak_activation_MiB"]
    assert list((tmp_path / "trace").glob("rank*.mscan"))


def test_bad_setup_is_one_line_exit_2(capsys):
    assert dpp_gpu_sim.main(["--device", "cpu", "--preset", "tiny"]) == 2  # 4 layers into PP4 x V2
    assert "do not split" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        dpp_gpu_sim.main(["--device", "cpu", "--pp", "2"])
    assert exc.value.code == 2


@pytest.mark.gpu
def test_cuda_run_times_chunks_with_cuda_events(tmp_path):
    """The same pipeline on CUDA (bf16, the tracer's CUDA-event clock): every task timed > 0."""
    code = dpp_gpu_sim.main(["--device", "cuda", "--preset", "tiny", "--num-layers", "8", "-m", "4", "--iters", "3",
                             "--seeds", "1", "--scenarios", "balanced", "--traversals", "in-order",
                             "--out", str(tmp_path)])
    assert code == 0
    doc = json.loads((tmp_path / "dpp_gpu_sim.json").read_text())
    assert doc["args"]["dtype"] == "bf16" and doc["device"] != "cpu"
    assert all(min(r) > 0 for r in doc["forward_s"] + doc["backward_s"])
