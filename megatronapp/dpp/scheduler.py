"""Per-rank scheduler state machine: ready tasks, in-flight cap, decisions. Pure, no I/O.

The runtime (and the simulator) drive it with events: `add_input(task)` when a task's
input arrived (a message, or a local producer finished), `decide()` when the rank is free,
`start(task)` / `finish(task)` around the compute. It never blocks and never communicates.

In-flight activations: the cap counts (chunk, microbatch) activation sets, Megatron's unit for
interleaved warm-up ("virtual microbatches"): F(c, m) creates one, B(c, m) frees it. With
V chunks per rank a microbatch holds up to V of them on a rank at once (at F(V-1, m)).
Microbatch m is *admitted* on rank p by its first forward there, F(chunk 0, m); chunk 0 is
this rank's lowest virtual stage, so every other task of m on this rank comes later.

Why no policy can deadlock for any cap >= V (the rules the code keeps). Let A be the
activation sets a rank holds and owed(m) the forwards admitted microbatch m still has to
run on it.
  (R1) a rank admits microbatches in increasing order (F(0, m) is ready only after
       F(0, m-1) ran);
  (R2) any forward F(c, m) may start only if A + 1 + owed(older admitted microbatches)
       <= cap: a newer microbatch never takes a slot an older one will still need;
  (R3) a rank is idle only when no task is ready; sends never block compute, and every
       rank always has the receive for each peer's next message posted, so a sent message
       is eventually received.
Suppose tasks remain but nothing can run. Let m* be the oldest microbatch with a task not
run and T the first task of its chain F(s=0..S-1), B(s=S-1..0) that has not run, on rank
p. T's input was produced (the previous task of the chain ran) and, by R3, has arrived;
every older microbatch is finished, so owed(older than m*) = 0 and A counts only m* and
newer microbatches. A backward needs no slot: T is ready. If T = F(0, m*): newer ones are
not admitted yet (R1), A = 0, and 0 + 1 <= cap: T is ready. Otherwise T is a forward of
an admitted m*. Take the last forward e of a newer microbatch m' on p (all came after m*
was admitted, by R1). R2 held at e: A_e + 1 + owed_e(m*) <= cap. Since e, newer
microbatches only freed slots, and m*'s own forwards moved units from owed(m*) to A, so
now A + owed(m*) <= cap; owed(m*) >= 1 (T is one), so A + 1 <= cap: T is ready. With no
such e, A + owed(m*) <= V <= cap likewise. Either way a rank has a ready task:
contradiction. Tasks are finite and every decision runs one, so each step completes,
whatever the policy picks (among ready tasks, whenever one is ready) and however late
messages are. The in-order policy waits instead and so leaves R3; it is deadlock-free for
another reason (policies.InOrderPolicy) and needs a cap its order fits (check_order_fits).
A cap below V fails: one
microbatch alone holds V activation sets on a rank before its first backward there, hence
`check_cap`. The randomised tests check this on real gloo ranks.

W filling (split backward, parallel/wgrad_defer.py). With `split_backward` a backward task
B(c, m) runs as I: the input gradient, sent upstream at once; its weight-gradient GEMMs wait
as W(c, m), a local task that is always ready. W is the filler: the rank runs the oldest
pending W exactly when the policy has nothing to run (no F/B ready, the cap binding, or the
in-order policy waiting for its next task), and the step is done only once every W ran (so
all of them precede the optimizer step). The cap counts a (chunk, microbatch) from its
forward until its W: pending-W state is capped with the activations. The argument above
still holds with A counting both: a pending W is always ready, so a rank with nothing ready
has no pending W, and then A counts activations only, as before; a W frees a unit and needs
none. Received inputs whose forward has not started are counted (`held`, `peak_held`) but
not capped: refusing an arrived message needs flow control with the sender, and counting
them in admission would let a newer microbatch's early input block an older one's forward
(breaking R2).
"""

from __future__ import annotations

from dataclasses import dataclass

from megatronapp.dpp.policies import InOrderPolicy, RankView, compute_depth_first_order
from megatronapp.dpp.tasks import FORWARD, WEIGHT_GRAD, compute_consumer, forward_task, weight_task
from megatronapp.pipeline.actions import Action, virtual_stage

_EWMA = 0.2  # weight of the newest observation in the wait-fraction average


class CapError(ValueError):
    """An in-flight cap that cannot work; one line."""


def check_cap(cap: int, num_chunks: int) -> None:
    """Refuse caps that cannot make progress (module docstring, R1)."""
    if cap < num_chunks:
        raise CapError(
            f"--dpp-max-inflight {cap} is below the {num_chunks} activation sets one microbatch "
            f"holds across this rank's {num_chunks} chunks: no microbatch could ever start"
        )


@dataclass(frozen=True)
class Decision:
    """One scheduling choice, with what the trace shows next to it."""

    task: Action
    policy: str  # the traversal that picked it (adaptive names its current mode)
    ready: tuple[Action, ...]
    in_flight: int  # activation sets held when it was picked

    def describe(self) -> str:
        ready = " ".join(f"{t.kind.value}{t.chunk}.{t.microbatch}" for t in self.ready)
        return f"{self.policy} inflight={self.in_flight} ready=[{ready}]"


class InflightCounter:
    """Activation sets and admitted microbatches held by one rank (module docstring); with
    `split_backward` a set is freed by its W, not by its backward."""

    def __init__(self, cap: int | None = None, split_backward: bool = False):
        self.cap, self.frees = cap, WEIGHT_GRAD if split_backward else None
        self.activations = self.microbatches = 0
        self.peak_activations = self.peak_microbatches = 0

    def start(self, task: Action) -> None:
        if task.kind is not FORWARD:
            return
        self.activations += 1
        if self.cap is not None and self.activations > self.cap:
            raise RuntimeError(f"in-flight cap {self.cap} exceeded by {task}")
        self.peak_activations = max(self.peak_activations, self.activations)
        if task.chunk == 0:
            self.microbatches += 1
            self.peak_microbatches = max(self.peak_microbatches, self.microbatches)

    def finish(self, task: Action) -> None:
        if task.kind is FORWARD or (self.frees is WEIGHT_GRAD and task.kind is not WEIGHT_GRAD):
            return
        self.activations -= 1
        if task.chunk == 0:
            self.microbatches -= 1


def check_order_fits(order: list[Action], cap: int, num_chunks: int, pp_rank: int) -> None:
    """Refuse (CapError, one line) a cap below the activation sets `order` holds at its peak on
    pipeline rank `pp_rank`: the in-order traversal, which admits by the cap alone (no R2
    reserve: it never reorders, so it needs none), would stop there."""
    check_cap(cap, num_chunks)
    peak = compute_peak_inflight(order)
    if peak > cap:
        raise CapError(
            f"--dpp-max-inflight {cap} is below the {peak} activation sets the in-order traversal "
            f"holds on pipeline rank {pp_rank} (the default cap fits)"
        )


class RankScheduler:
    """Ready set, admission and decisions of one pipeline rank for one step."""

    def __init__(
        self,
        pp_rank: int,
        pp_size: int,
        num_chunks: int,
        num_microbatches: int,
        cap: int,
        policy,
        split_backward: bool = False,
    ):
        check_cap(cap, num_chunks)
        self.reserve_for_older = not isinstance(policy, InOrderPolicy)  # R2; in-order needs only the cap
        if not self.reserve_for_older:
            check_order_fits(policy.order, cap, num_chunks, pp_rank)
        self.pp_rank, self.pp_size, self.num_chunks = pp_rank, pp_size, num_chunks
        self.num_microbatches, self.cap, self.policy = num_microbatches, cap, policy
        self.counter = InflightCounter(cap, split_backward)
        self.split_backward = split_backward
        self.available: set[Action] = set()  # input present, not yet started
        self.pending_w: list[Action] = []  # W tasks whose backward ran, oldest first (the filler)
        self.peak_held = 0  # activation sets + pending W + received inputs not yet forwarded
        self.next_admit = 0  # R1: the only microbatch whose F(0, .) may start
        self.owed: dict[int, int] = {}  # admitted microbatch -> forwards it still runs here (R2)
        self.remaining = (3 if split_backward else 2) * num_chunks * num_microbatches
        self.wait_fraction = 0.0
        self.started: set[Action] = set()
        if virtual_stage(0, pp_rank, pp_size) == 0:  # tokens are local: every F(0, m) has its input
            self.available.update(forward_task(0, m) for m in range(num_microbatches))

    @property
    def done(self) -> bool:
        return self.remaining == 0

    def add_input(self, task: Action) -> None:
        """The input of `task` has arrived (message received, or local producer finished)."""
        self.available.add(task)
        self.peak_held = max(self.peak_held, self.held)

    @property
    def held(self) -> int:
        """Activation sets and pending W (both capped) plus received, not yet forwarded inputs."""
        waiting = sum(1 for t in self.available if t.kind is FORWARD and t.chunk + self.pp_rank > 0)
        return self.counter.activations + waiting

    def _admissible(self, task: Action) -> bool:
        if task.kind is not FORWARD:
            return True
        m = task.microbatch
        if task.chunk == 0 and m != self.next_admit:
            return False
        older = [k for k in self.owed if k < m] if self.reserve_for_older else []  # admitted, forwards left (R2)
        reserve = self.owed[min(older)] if older else 0
        return self.counter.activations + 1 + reserve <= self.cap

    def ready(self) -> list[Action]:
        return [t for t in self.available if self._admissible(t)]

    def decide(self) -> Decision | None:
        """The task to run next by the policy, or None when nothing is ready (or, in-order,
        while the order's next task is not)."""
        ready = self.ready()
        task = None
        if ready:
            view = RankView(self.counter.activations, self.cap, self.wait_fraction, self.started)
            task, policy = self.policy.choose(ready, view)  # None: the in-order policy waits
        if task is None and self.pending_w:  # nothing else to run now: fill with the oldest W
            task, policy = self.pending_w[0], "w-fill"
        if task is None:
            return None
        return Decision(task, policy, tuple(sorted(ready, key=_sort_key)), self.counter.activations)

    def start(self, task: Action) -> None:
        if task.kind is WEIGHT_GRAD:
            if task not in self.pending_w:
                raise RuntimeError(f"pp rank {self.pp_rank}: {task} started but its backward has not run")
            self.pending_w.remove(task)
            self.started.add(task)
            return
        if task not in self.available or not self._admissible(task):
            raise RuntimeError(f"pp rank {self.pp_rank}: {task} started but it is not ready")
        self.available.remove(task)
        self.started.add(task)
        self._account_start(task)

    def _account_start(self, task: Action) -> None:
        if task.kind is FORWARD:
            m = task.microbatch
            if task.chunk == 0:
                self.next_admit += 1
                self.owed[m] = self.num_chunks
            self.owed[m] -= 1
            if not self.owed[m]:
                del self.owed[m]
        self.counter.start(task)

    def finish(self, task: Action) -> tuple[int, Action] | None:
        """Account a finished task; returns (pp rank, task) its output must be sent to, or None.

        A consumer on this rank (pp_size 1, or the loss feeding its own backward) is made
        available here and None is returned.
        """
        self.counter.finish(task)
        self.remaining -= 1
        if task.kind is WEIGHT_GRAD:
            return None
        if self.split_backward and task.kind is not FORWARD:  # it ran as I: its W is now pending
            self.pending_w.append(weight_task(task.chunk, task.microbatch))
            self.peak_held = max(self.peak_held, self.held)
        return route_output(self, task)

    def observe(self, busy_s: float, waited_s: float) -> None:
        """Record one task's compute time and the wait before it (adaptive's input)."""
        total = busy_s + waited_s
        if total > 0:
            self.wait_fraction += _EWMA * (waited_s / total - self.wait_fraction)


def route_output(agent, task: Action) -> tuple[int, Action] | None:
    """Where `task`'s output goes: (pp rank, task) on another rank, or None after making a
    consumer on `agent`'s own rank available (`agent.add_input`). Shared by every scheduler
    and by the simulator's static agents."""
    consumer = compute_consumer(task, agent.pp_rank, agent.pp_size, agent.num_chunks)
    if consumer is not None and consumer[0] == agent.pp_rank:
        agent.add_input(consumer[1])
        return None
    return consumer


def _sort_key(t: Action) -> tuple[int, int, int]:
    return (t.kind is not FORWARD, t.chunk, t.microbatch)


def compute_peak_inflight(order: list[Action]) -> int:
    """Peak activation sets one rank holds running `order` (compute actions only)."""
    counter = InflightCounter()
    for task in order:
        counter.start(task)
        counter.finish(task)
    return counter.peak_activations


def compute_default_caps(pp_size: int, num_chunks: int, num_microbatches: int) -> list[int]:
    """Per pipeline rank: the activation sets interleaved 1F1B (1F1B for V = 1) holds at its
    peak, for any M (policies.compute_depth_first_order); never below V (check_cap)."""
    orders = [compute_depth_first_order(p, pp_size, num_chunks, num_microbatches) for p in range(pp_size)]
    return [max(num_chunks, compute_peak_inflight(order)) for order in orders]
