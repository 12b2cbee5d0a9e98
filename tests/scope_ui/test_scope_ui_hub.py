"""The UI server's decisions without sockets or a model: who may rerun the model, what a client
is told when the server fails, and how much work one perturb message may ask for."""

from __future__ import annotations

import logging

import pytest
import torch

from megatronapp.config import ModelConfig
from megatronapp.scope.perturb import corrupt_with_mask
from megatronapp.scope.specs import perturbation_from_dict
from megatronapp.scope_ui import protocol as P
from megatronapp.scope_ui.runner import PerturbationSet, compute_perturbation_draws
from megatronapp.scope_ui.server import Hub, _receive_one

SECRET = "/home/someone/weights/shard-3.pt"


class FakeGenerationBackend:
    """The GenerationRunner surface the Hub uses; records the refills it is asked for."""

    mode = "generate"
    info = {"num_layers": 4, "num_heads": 2}

    def __init__(self, fail_with: Exception | None = None):
        self.refills, self.fail_with = [], fail_with

    def needs_refill(self, layer: int) -> bool:
        return True

    def refill(self, layer: int, sink) -> None:
        if self.fail_with is not None:
            raise self.fail_with
        self.refills.append(layer)


def build_hub(backend) -> tuple[Hub, list]:
    """A Hub whose outbound messages land in the returned list (no event loop, no sockets)."""
    hub, sent = Hub(backend, P.Limits()), []
    hub.send = lambda client, msg: sent.append((client, msg))
    return hub, sent


def view(layer: int) -> P.View:
    return P.View(type="view", layer=layer, head=0)


def test_only_the_driving_tab_reruns_the_model_for_its_view():
    backend = FakeGenerationBackend()
    hub, _ = build_hub(backend)
    driver, watcher = hub.join(object()), hub.join(object())
    hub.handle(watcher, view(2))
    hub.handle(driver, view(1))
    hub.worker.shutdown(wait=True)  # every refill submitted has run
    assert backend.refills == [1]
    assert hub.layers_shown() == [1, 2]  # the watcher's layer is captured by the next generation


def test_a_model_side_failure_is_logged_and_the_tab_gets_a_code(caplog):
    hub, sent = build_hub(FakeGenerationBackend(fail_with=FileNotFoundError(SECRET)))
    driver = hub.join(object())
    with caplog.at_level(logging.ERROR, logger="megatronapp.scope_ui.server"):
        hub.handle(driver, view(3))
        hub.worker.shutdown(wait=True)
    assert [msg.code for _, msg in sent] == ["internal"]
    assert SECRET not in sent[0][1].message
    assert SECRET in caplog.text  # the traceback stays on the server


def test_a_capture_over_its_limit_is_refused_with_its_reason():
    from megatronapp.scope.capture import CaptureLimitError

    hub, sent = build_hub(FakeGenerationBackend(fail_with=CaptureLimitError("capture would need 9 bytes")))
    driver = hub.join(object())
    hub.handle(driver, view(1))
    hub.worker.shutdown(wait=True)
    assert [(msg.code, msg.message) for _, msg in sent] == [("too_large", "capture would need 9 bytes")]


def test_a_handler_bug_is_logged_and_the_tab_gets_a_code(caplog):
    hub, sent = build_hub(FakeGenerationBackend())
    client = hub.join(object())

    def broken(client, msg):
        raise KeyError(SECRET)

    hub.handle = broken
    with caplog.at_level(logging.ERROR, logger="megatronapp.scope_ui.server"):
        _receive_one(hub, client, {"type": "websocket.receive", "text": '{"type": "hello", "version": 2}'})
    assert [msg.code for _, msg in sent] == ["internal"] and SECRET not in sent[0][1].message
    assert SECRET in caplog.text


def test_a_refused_request_keeps_its_code_and_message():
    hub, sent = build_hub(FakeGenerationBackend())
    hub.join(object())
    watcher = hub.join(object())
    _receive_one(hub, watcher, {"type": "websocket.receive", "text": '{"type": "clear_perturbations"}'})
    assert sent[0][1].code == "not_driver" and "watches" in sent[0][1].message


CFG = ModelConfig(num_layers=2, hidden_size=16, num_attention_heads=2, seq_length=8)


@pytest.mark.parametrize(
    "fields",
    [
        {"kind": "gaussian", "sigma": 0.1, "rate": 0.5},
        {"kind": "uniform", "low": 0.5, "high": 2.0},
        {"kind": "bitflip", "field": "mantissa", "num_bits": 2, "rate": 0.25},
        {"kind": "bitflip", "field": "exponent"},
        {"kind": "stuck_at", "bits": [3], "stuck": 1},
        {"kind": "offset", "value": 1.0, "rate": 0.5},
    ],
)
def test_draw_count_is_what_applying_the_perturbation_draws(fields, monkeypatch):
    """The bound is checked on the count the code actually draws: torch.rand/randn outputs
    counted while one (6, 5) parameter is corrupted."""
    shapes = {"w": (6, 5)}
    spec = perturbation_from_dict({**fields, "target": {"site": "param", "param": "w"}, "seed": 1})
    drawn = []
    for name in ("rand", "randn"):
        real = getattr(torch, name)
        monkeypatch.setattr(
            torch, name, lambda *a, _real=real, **k: drawn.append(_real(*a, **k).numel()) or _real(*a, **k)
        )
    corrupt_with_mask(torch.ones(6, 5), spec, torch.ones(6, 5, dtype=torch.bool), None, torch.Generator())
    assert compute_perturbation_draws(spec, CFG, shapes) == sum(drawn)


def test_a_perturbation_over_the_draw_limit_is_refused_before_it_is_added():
    """Random mantissa bits on a 2^20 x 8 parameter would draw 8M x 23 values (an argsort over
    them: several GiB); refused with "too_large". Fixed bits or noise on it fit."""
    shapes = {"big": (1 << 20, 8)}
    perturbations = PerturbationSet(CFG, shapes, limit=16, max_draws=P.Limits().max_perturb_draws)
    target = {"site": "param", "param": "big"}
    with pytest.raises(P.ProtocolError) as refused:
        perturbations.add({"kind": "bitflip", "field": "mantissa", "target": target})
    assert refused.value.error.code == "too_large" and str(8 * (1 << 20) * 23) in refused.value.error.message
    assert perturbations.specs == []
    perturbations.add({"kind": "bitflip", "bits": [22], "target": target})
    perturbations.add({"kind": "gaussian", "sigma": 0.1, "target": target})
    assert len(perturbations.specs) == 2
