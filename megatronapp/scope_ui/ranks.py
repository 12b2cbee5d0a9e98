"""Serving a model that spans several ranks (TP x PP): rank 0 runs the web server, every
rank runs the same generation.

The UI's requests reach rank 0 only. Before rank 0 starts a generation it publishes the
job — the validated `generate` message, the active perturbation specs and the shown layers
(or a refill: one layer of the last request), as JSON — to
every rank (`JobChannel`: a length, then the UTF-8 bytes as a uint8 tensor, broadcast over
the world group; no pickling). Each follower rebuilds the same request from it and runs
the same `GenerationRunner.run`, so every collective of generate(), capture() and
perturb() is issued by every rank in the same order (captures are gathered to rank 0,
which streams them). A `stop` job ends the followers when the server exits.
"""

from __future__ import annotations

import json
import logging

import torch
import torch.distributed as dist

from megatronapp.scope.specs import perturbation_from_dict
from megatronapp.scope_ui import protocol as P

log = logging.getLogger("megatronapp.scope_ui")
LEADER = 0


class JobChannel:
    """Rank 0 -> all ranks: one JSON object per job, over the world group."""

    def __init__(self, device: torch.device):
        self.device = device

    def publish(self, job: dict) -> None:
        data = torch.tensor(list(json.dumps(job).encode()), dtype=torch.uint8, device=self.device)
        dist.broadcast(torch.tensor([data.numel()], dtype=torch.long, device=self.device), src=LEADER)
        dist.broadcast(data, src=LEADER)

    def receive(self) -> dict:
        size = torch.zeros(1, dtype=torch.long, device=self.device)
        dist.broadcast(size, src=LEADER)
        data = torch.empty(int(size), dtype=torch.uint8, device=self.device)
        dist.broadcast(data, src=LEADER)
        return json.loads(bytes(data.cpu().tolist()).decode())


class LeaderRunner:
    """The GenerationRunner of rank 0, publishing each generation to the followers first."""

    def __init__(self, runner, channel: JobChannel):
        self.runner, self.channel = runner, channel

    def __getattr__(self, name):  # mode, info, perturbations, check, welcome_fields, backlog, ...
        return getattr(self.runner, name)

    def run(self, msg: P.Generate, sink, layers) -> None:
        self.runner.check(msg)  # refuse here, before any rank starts work
        self.channel.publish(
            {
                "kind": "generate",
                "msg": msg.model_dump(),
                "layers": list(layers),
                "perturbations": self.runner.perturbations.as_dicts(),
            }
        )
        self.runner.run(msg, sink, layers)

    def refill(self, layer: int, sink) -> None:
        if self.runner.needs_refill(layer):
            self.channel.publish({"kind": "refill", "layer": layer})
            self.runner.refill(layer, sink)

    def stop(self) -> None:
        self.channel.publish({"kind": "stop"})


def follow(runner, channel: JobChannel) -> int:
    """Run rank 0's generations on this rank until it says stop; returns the jobs run."""
    done = 0
    while True:
        job = channel.receive()
        if job["kind"] == "stop":
            return done
        try:
            if job["kind"] == "refill":
                runner.refill(int(job["layer"]), _Drop())
            else:
                runner.perturbations.specs = [perturbation_from_dict(d) for d in job["perturbations"]]
                runner.run(P.Generate.model_validate(job["msg"]), _Drop(), [int(x) for x in job["layers"]])
        except Exception as e:  # rank 0 sees the same failure and reports it to the page
            log.warning("generation failed on this rank: %s: %s", type(e).__name__, e)
        done += 1


class _Drop:
    """Followers' sink: only rank 0 talks to the page."""

    def post(self, items) -> None:
        pass
