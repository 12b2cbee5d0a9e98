"""Static schedules as simulator agents, under two models of their communication.

  * "eager": a rank waits only for the input of its next compute; a message arrives
    `transfer_s` after its producer ended, whatever the receiver is doing. This is a static
    order run by a runtime that posts every receive ahead (as the dynamic runtime does);
  * "rendezvous": pipeline/transport.py's BatchedTransport on gloo
    (the default; "eager" is --pipeline-recv-ahead). Each maximal run of comm actions is
    one batch, posted when the rank reaches it; a compute that consumes a received tensor
    waits for its *whole* batch (`batch_isend_irecv` works, sends included); a gloo send
    moves data only once the receiver has posted the matching recv (gloo's tcp pair queues
    the send and announces it until the peer's recv arrives), so an op completes at
    max(send posted, recv posted) + transfer. Sends left in a batch nobody waits for are
    completed at the end of the step. Messages of a directed pair match in FIFO order.
Both agents have RankScheduler's interface (done, decide, start, finish, add_input,
observe, counter), so simulator.py drives them like dynamic ranks.
"""

from __future__ import annotations

from megatronapp.dpp.scheduler import Decision, InflightCounter, route_output
from megatronapp.dpp.tasks import compute_producer_rank
from megatronapp.pipeline.actions import Action, ActionKind, PipelineSchedule

STATIC_COMM_MODELS = ("eager", "rendezvous")
_SENDS = (ActionKind.SEND_FORWARD, ActionKind.SEND_BACKWARD)


class EagerStaticAgent:
    """A rank running a fixed compute order that waits only for its own inputs."""

    def __init__(self, pp_rank: int, schedule: PipelineSchedule):
        self.pp_rank, self.pp_size, self.num_chunks = pp_rank, schedule.pp_size, schedule.num_chunks
        self.order = [a for a in schedule.for_rank(pp_rank) if not a.kind.is_comm]
        self.index, self.arrived = 0, set()
        self.counter = InflightCounter(split_backward=_has_w(self.order))

    @property
    def done(self) -> bool:
        return self.index == len(self.order)

    def add_input(self, task: Action | None) -> None:
        self.arrived.add(task)

    def decide(self) -> Decision | None:
        task = self.order[self.index]
        if task.kind is ActionKind.BACKWARD_WEIGHT:  # local: its I ran earlier in the order
            return Decision(task, "static", (task,), self.counter.activations)
        needed = Action(ActionKind.BACKWARD, task.chunk, task.microbatch) if task.kind.is_backward else task
        if compute_producer_rank(task, self.pp_rank, self.pp_size, self.num_chunks) is None or needed in self.arrived:
            return Decision(task, "static", (task,), self.counter.activations)
        return None

    def start(self, task: Action) -> None:
        self.index += 1
        self.counter.start(task)

    def finish(self, task: Action) -> tuple[int, Action] | None:
        self.counter.finish(task)
        return None if task.kind is ActionKind.BACKWARD_WEIGHT else route_output(self, task)

    def observe(self, busy_s: float, waited_s: float) -> None:
        pass


class RendezvousHub:
    """Posted ops of every rank, keyed (src, dst, k-th message); completion times once matched."""

    def __init__(self, transfer_s):
        self.transfer_s = transfer_s  # (src, dst) -> seconds once both sides posted
        self.wake = self.now = None  # bound by the simulation: wake(t, pp_rank) re-decides at t; now()
        self.posted: dict[tuple[int, int, int], float] = {}
        self.complete: dict[tuple[int, int, int], float] = {}

    def post(self, key: tuple[int, int, int], now: float) -> None:
        if key not in self.posted:
            self.posted[key] = now
            return
        src, dst, _ = key
        self.complete[key] = t = max(now, self.posted.pop(key)) + self.transfer_s(src, dst)
        self.wake(t, src)
        self.wake(t, dst)


class RendezvousStaticAgent:
    """A rank running the static runtime's action list, batches and all (module docstring)."""

    def __init__(self, pp_rank: int, schedule: PipelineSchedule, hub: RendezvousHub):
        self.pp_rank, self.hub = pp_rank, hub
        self.counter = InflightCounter(split_backward=_has_w(schedule.for_rank(pp_rank)))
        self.items: list = []  # compute Action, or list of op keys (one batch)
        self.waits: dict[int, int] = {}  # item index of a compute -> index of the batch it waits for
        self._build(schedule.for_rank(pp_rank))
        self.index = 0

    def _build(self, actions) -> None:
        sent, received, recv_batch = {}, {}, {}
        for a in actions:
            if not a.kind.is_comm:
                key = (
                    ActionKind.RECV_FORWARD if a.kind is ActionKind.FORWARD else ActionKind.RECV_BACKWARD,
                    a.chunk,
                    a.microbatch,
                )
                if key in recv_batch:
                    self.waits[len(self.items)] = recv_batch.pop(key)
                self.items.append(a)
                continue
            if not self.items or not isinstance(self.items[-1], list):
                self.items.append([])
            count = sent if a.kind in _SENDS else received
            n = count[a.peer] = count.get(a.peer, -1) + 1
            pair = (self.pp_rank, a.peer) if a.kind in _SENDS else (a.peer, self.pp_rank)
            self.items[-1].append((*pair, n))
            if a.kind not in _SENDS:
                recv_batch[(a.kind, a.chunk, a.microbatch)] = len(self.items) - 1

    @property
    def done(self) -> bool:
        return self.index == len(self.items)

    def add_input(self, task: Action | None) -> None:
        pass  # inputs travel through the hub's batches

    def decide(self) -> Decision | None:
        while not self.done and isinstance(self.items[self.index], list):  # reaching a batch posts it
            for key in self.items[self.index]:
                self.hub.post(key, self.hub.now())
            self.index += 1
        if self.done:
            return None
        batch = self.waits.get(self.index)
        if batch is not None:
            times = [self.hub.complete.get(k) for k in self.items[batch]]
            if None in times or max(times) > self.hub.now():
                return None
        task = self.items[self.index]
        return Decision(task, "static", (task,), self.counter.activations)

    def start(self, task: Action) -> None:
        self.index += 1
        self.counter.start(task)

    def finish(self, task: Action) -> None:
        self.counter.finish(task)  # outputs leave through the next batch

    def observe(self, busy_s: float, waited_s: float) -> None:
        pass


def _has_w(order) -> bool:
    return any(a.kind is ActionKind.BACKWARD_WEIGHT for a in order)


def build_static_agents(schedule: PipelineSchedule, comm: str, transfer_s) -> tuple[list, RendezvousHub | None]:
    """One agent per pipeline rank under the comm model `comm`, and the hub to bind (rendezvous)."""
    if comm not in STATIC_COMM_MODELS:
        raise ValueError(f"unknown static comm model {comm!r}; choose one of {', '.join(STATIC_COMM_MODELS)}")
    if comm == "eager":
        return [EagerStaticAgent(p, schedule) for p in range(schedule.pp_size)], None
    hub = RendezvousHub(transfer_s)
    return [RendezvousStaticAgent(p, schedule, hub) for p in range(schedule.pp_size)], hub
