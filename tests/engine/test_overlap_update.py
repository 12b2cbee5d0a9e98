"""--overlap-param-update: which parameters each unit's update covers (CPU), and on CUDA that the
overlapped update trains as the serial one even when the side stream starts late."""

from __future__ import annotations

import pytest
import torch
from engine_jobs import RandomTokenBatches

from megatronapp.config import build_layout, model_preset
from megatronapp.engine.overlap_update import chunk_units, partition_by_unit
from megatronapp.engine.trainer import Trainer
from megatronapp.job import build_job
from megatronapp.model.gpt import GPTChunk, TPContext
from megatronapp.parallel.groups import single_process_groups


def test_partition_gives_each_param_to_its_first_unit_and_strays_to_the_first():
    # units list param ids 10, 11 | 11, 12 | 13; params 12, 11, 99 (no unit), 13, 10
    owned = partition_by_unit([[10, 11], [11, 12], [13]], [12, 11, 99, 13, 10])
    assert owned == [[1, 2, 4], [0], [3]]


@pytest.mark.parametrize("first, last", [(0, 4), (0, 2), (2, 4), (1, 3)], ids=["whole", "first", "last", "middle"])
def test_gpt_units_cover_every_parameter_once_in_forward_order(first, last):
    cfg = model_preset("tiny")
    chunk = GPTChunk(cfg, first, last, TPContext(None, 1, 0), seed=0)
    units = chunk_units(chunk)
    flat = [id(p) for _, params in units for p in params]
    assert sorted(flat) == sorted(id(p) for p in chunk.parameters()) and len(set(flat)) == len(flat)
    blocks = list(chunk.layers.values())
    modules = [m for m, _ in units]
    expected = ([chunk.embedding] if first == 0 else []) + blocks
    assert modules == expected
    if last == cfg.num_layers:  # the head's update is waited for before the last layer
        assert id(chunk.output.weight) in {id(p) for p in units[-1][1]}


def _train_bf16(overlap: bool, **precision_kw) -> tuple[list[float], list[float], bool]:
    job = build_job(
        model_preset("small", num_layers=4, seq_length=128),
        build_layout(1, 1, 1),
        micro_batch_size=2,
        global_batch_size=4,
        train_iters=6,
        lr=3e-3,
        clip_grad=1.0,
        bf16=True,
        overlap_param_update=overlap,
        **precision_kw,
    )
    torch.manual_seed(0)
    trainer = Trainer(job, single_process_groups(), torch.device("cuda"), RandomTokenBatches(job, 0))
    assert (trainer.optimizer.overlapped_update is not None) == overlap
    metrics = trainer.train(6)
    # The test below removes the waits on purpose: its side stream may still be writing when the
    # trainer's memory goes back to the allocator, and the next test's tensors would get its
    # writes (the fp32 CPU-vs-CUDA test read a 0.05 higher first loss after it, 2026-12-04).
    torch.cuda.synchronize()
    opt = trainer.optimizer
    rounded = all(torch.equal(opt._model_view(m), m.main_param.to(torch.bfloat16)) for m in opt.mains)
    return [m.loss for m in metrics], [m.grad_norm for m in metrics], rounded


# ~10 ms at the H200's clock: long enough for a forward that does not wait to run ahead of the update
LATE = 20_000_000


@pytest.mark.gpu
@pytest.mark.parametrize("delay", [0, LATE], ids=["no_delay", "side_stream_late"])
def test_overlapped_update_trains_as_the_serial_update(delay, monkeypatch):
    """With the side stream held back before its first launch, a forward that did not wait for
    its unit would read last step's weights and the losses would leave the serial run's."""
    from megatronapp.engine import overlap_update

    monkeypatch.setattr(overlap_update, "LAUNCH_DELAY_CYCLES", delay)
    losses, norms, rounded = _train_bf16(False)
    o_losses, o_norms, o_rounded = _train_bf16(True)
    assert abs(losses[-1] - losses[0]) > 0.05  # the updates move the loss: stale weights would show
    torch.testing.assert_close(o_losses, losses, rtol=2e-3, atol=0)
    torch.testing.assert_close(o_norms, norms, rtol=2e-3, atol=0)
    assert rounded and o_rounded


PRECISION_AWARE = {
    "use_precision_aware_optimizer": True,
    "exp_avg_dtype": "bf16",
    "exp_avg_sq_dtype": "bf16",
    "main_grads_dtype": "bf16",
}


@pytest.mark.gpu
def test_overlapped_precision_aware_update_trains_as_its_serial_update(monkeypatch):
    """Remainders, bf16 moments and bf16 main grads, unit by unit on the side stream (held back)."""
    from megatronapp.engine import overlap_update

    monkeypatch.setattr(overlap_update, "LAUNCH_DELAY_CYCLES", LATE)
    losses, norms, _ = _train_bf16(False, **PRECISION_AWARE)
    o_losses, o_norms, _ = _train_bf16(True, **PRECISION_AWARE)
    assert abs(losses[-1] - losses[0]) > 0.05
    torch.testing.assert_close(o_losses, losses, rtol=2e-3, atol=0)
    torch.testing.assert_close(o_norms, norms, rtol=2e-3, atol=0)


@pytest.mark.gpu
def test_without_the_waits_the_late_update_is_seen(monkeypatch):
    """The test above can fail: with the forward's waits removed, the same late side stream
    makes the forward read weights one update behind, and the losses leave the serial run's."""
    from megatronapp.engine import overlap_update

    monkeypatch.setattr(overlap_update, "LAUNCH_DELAY_CYCLES", LATE)
    losses, _, _ = _train_bf16(False)
    monkeypatch.setattr(overlap_update.OverlappedUpdate, "wait_unit", lambda self, k: None)
    monkeypatch.setattr(overlap_update.OverlappedUpdate, "wait_chunk", lambda self, c: None)
    o_losses, _, _ = _train_bf16(True)
    assert max(abs(a - b) / abs(b) for a, b in zip(o_losses[1:], losses[1:])) > 2e-3
