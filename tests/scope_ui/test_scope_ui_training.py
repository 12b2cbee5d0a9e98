"""The training view's step reports: per-layer norms computed on device without a sync match a
per-parameter reference, and the reporter thread keeps the page's order (a step's report
before the "waiting after it" state)."""

from __future__ import annotations

import math
import threading
import time

import torch
from scope_ui_jobs import build_trainer

from megatronapp.data.tokenizer import load_tokenizer
from megatronapp.scope_ui import protocol as P
from megatronapp.scope_ui.probe import LayerNorms
from megatronapp.scope_ui.training import TrainingScope


class _RecordingHub:
    def __init__(self):
        self.messages, self.lock = [], threading.Lock()

    def broadcast(self, msg) -> None:
        self.post([msg])

    def post(self, items) -> None:
        with self.lock:
            self.messages.extend(items)


def _reference_norms(trainer) -> tuple[list[float], list[float]]:
    num_layers = trainer.job.model.num_layers
    w, g = [0.0] * num_layers, [0.0] * num_layers
    for name, p in trainer.chunks[0].named_parameters():
        parts = name.split(".")
        if "layers" not in parts:
            continue
        layer = int(parts[parts.index("layers") + 1])
        w[layer] += float(p.detach().double().pow(2).sum())
        grad = p.grad if p.grad is not None else getattr(p, "main_grad", None)
        g[layer] += float(grad.double().pow(2).sum())
    return [math.sqrt(v) for v in w], [math.sqrt(v) for v in g]


def test_layer_norms_match_per_parameter_reference():
    torch.set_num_threads(1)
    from megatronapp.scope.target import resolve_target

    trainer = build_trainer(iters=10)
    norms = LayerNorms(resolve_target(trainer.chunks).named_params(), trainer.job.model.num_layers)
    seen = []  # at on_step time, as the training view measures
    trainer.train(num_steps=1, on_step=lambda m: seen.append((norms.finish(norms.start()), _reference_norms(trainer))))
    (((weights, grads), (want_w, want_g)),) = seen
    assert all(v > 0 for v in want_g)
    assert torch.allclose(torch.tensor(weights), torch.tensor(want_w), rtol=1e-5)
    assert torch.allclose(torch.tensor(grads), torch.tensor(want_g), rtol=1e-5)


def test_step_report_precedes_the_waiting_state():
    torch.set_num_threads(1)
    trainer = build_trainer(iters=10)
    scope = TrainingScope(trainer, load_tokenizer(None), "The quick", 100, 4)
    scope.hub = hub = _RecordingHub()
    try:
        scope.control("pause")
        worker = threading.Thread(target=lambda: trainer.train(num_steps=1, on_step=scope.wrap(lambda m: None)))
        worker.start()
        deadline = time.monotonic() + 120
        while not any(isinstance(m, P.TrainState) and m.waiting for m in hub.messages):
            assert time.monotonic() < deadline, hub.messages
            time.sleep(0.01)
        with hub.lock:
            kinds = [(type(m).__name__, getattr(m, "waiting", None)) for m in hub.messages]
        assert kinds.index(("TrainStep", None)) < kinds.index(("TrainState", True))
        step = next(m for m in hub.messages if isinstance(m, P.TrainStep))
        assert step.iteration == trainer.iteration and len(step.layer_grad_norms) == trainer.job.model.num_layers
        scope.control("resume")
        worker.join(timeout=120)
        assert not worker.is_alive()
    finally:
        scope.close()


def test_evaluations_reach_the_page_after_their_steps():
    torch.set_num_threads(1)
    from eval_jobs import HeldOutTokenBatches

    from megatronapp.job import replace_fields

    trainer = build_trainer(iters=10)
    trainer.job = replace_fields(trainer.job, eval_interval=2, eval_iters=2)
    scope = TrainingScope(trainer, load_tokenizer(None), "The quick", 100, 4)
    scope.hub = hub = _RecordingHub()
    try:
        trainer.train(num_steps=2, on_step=scope.wrap(lambda m: None))
        result = trainer.evaluate("valid", HeldOutTokenBatches(trainer.job, 0))
        deadline = time.monotonic() + 60
        while not any(isinstance(m, P.TrainEval) for m in hub.messages):
            assert time.monotonic() < deadline, hub.messages
            time.sleep(0.01)
        with hub.lock:
            kinds = [type(m).__name__ for m in hub.messages]
        assert kinds.index("TrainEval") > max(i for i, k in enumerate(kinds) if k == "TrainStep")
        message = next(m for m in hub.messages if isinstance(m, P.TrainEval))
        assert (message.split, message.iteration, message.loss, message.ppl) == ("valid", 2, result.loss, result.ppl)
        assert message in scope.backlog()  # a tab that connects later gets it too
    finally:
        scope.close()
    assert trainer.eval_observer is None
