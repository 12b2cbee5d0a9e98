"""Event-driven simulation of one pipeline step, static or dynamic, against a cost model.

Model: each rank runs one compute task at a time. A task's output message to another rank
arrives `p2p_latency_s + message_bytes / p2p_bandwidth_Bps` (+ the pair's `link_delay_s`)
after the task ends (sends are asynchronous, so the sender continues at once; a local output
is available at once). A rank that is free picks its next task from what has *arrived* by
then: a dynamic rank asks its `RankScheduler`; a static schedule takes the next action of
its list, under one of two comm models (static_agents.py): "eager" (it waits only for its
input, as above) or "rendezvous" (the static runtime on gloo: batches waited whole, a send
moves only once its receiver posted the recv). Task time = the cost model's time for
(rank, chunk, kind) times the rank's jitter factor, drawn uniformly from [1, max_factor] by
a generator seeded with (seed, rank) in the order the rank runs its tasks (`JitterSpec`, the
same rule as the runtime's injection), plus `task_overhead_s` (host work between spans) and,
for dynamic decisions, `decision_s`. A span covers the task's compute; the overhead is
counted busy too. All events of one instant are applied before any rank decides, so a
decision sees every message that arrived by then.
"""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass, field

from megatronapp.dpp.config import JitterSpec
from megatronapp.dpp.policies import build_policy
from megatronapp.dpp.scheduler import Decision, RankScheduler
from megatronapp.dpp.sim.static_agents import build_static_agents
from megatronapp.dpp.tasks import FORWARD
from megatronapp.pipeline.actions import Action, ActionKind, PipelineSchedule


@dataclass(frozen=True)
class CostModel:
    """Seconds per task: forward_s[pp_rank][chunk], backward_s[pp_rank][chunk]; P2P link."""

    forward_s: tuple[tuple[float, ...], ...]
    backward_s: tuple[tuple[float, ...], ...]
    p2p_latency_s: float = 0.0
    p2p_bandwidth_Bps: float = float("inf")
    message_bytes: int = 0
    jitter: tuple[JitterSpec, ...] = ()
    decision_s: float = 0.0  # extra host time per dynamic decision
    # host time around every task outside its span (posting comm, bookkeeping): one value, or
    # one per pp rank (trace_costs.estimate_task_overheads_s: a rank waiting on its sends to a
    # slow peer has longer gaps than the slow peer itself, and a pooled mean overcharges it)
    task_overhead_s: float | tuple[float, ...] = 0.0
    link_delay_s: tuple[tuple[int, int, float], ...] = ()  # (src pp rank, dst pp rank, extra seconds per message)
    # split backward: the share of a backward's time that is W (the rest is I); Qi et al.'s
    # model (F = I = W) gives one half
    weight_grad_share: float = 0.5

    @classmethod
    def uniform(cls, pp_size: int, num_chunks: int, forward_s: float = 1.0, backward_s: float = 2.0, **kw) -> CostModel:
        return cls(((forward_s,) * num_chunks,) * pp_size, ((backward_s,) * num_chunks,) * pp_size, **kw)

    def task_overhead_of(self, pp_rank: int) -> float:
        o = self.task_overhead_s
        return o[pp_rank] if isinstance(o, tuple) else o

    def task_s(self, pp_rank: int, task: Action, split_backward: bool = False) -> float:
        if task.kind is FORWARD:
            return self.forward_s[pp_rank][task.chunk]
        whole = self.backward_s[pp_rank][task.chunk]
        if task.kind is ActionKind.BACKWARD_WEIGHT:
            return whole * self.weight_grad_share
        if split_backward or task.kind is ActionKind.BACKWARD_INPUT:  # B run as I
            return whole * (1.0 - self.weight_grad_share)
        return whole

    def transfer_s(self, src: int | None = None, dst: int | None = None) -> float:
        extra = sum(d for s, t, d in self.link_delay_s if (s, t) == (src, dst))
        return self.p2p_latency_s + self.message_bytes / self.p2p_bandwidth_Bps + extra


@dataclass(frozen=True)
class Span:
    pp_rank: int
    task: Action
    start_s: float
    end_s: float
    decision: Decision | None = None


@dataclass
class SimResult:
    makespan_s: float
    bubble_fraction: float
    peak_inflight: list[int]  # microbatches, per pipeline rank
    peak_activations: list[int]  # (chunk, microbatch) activation sets, per pipeline rank
    spans: list[Span] = field(default_factory=list)


class _Simulation:
    def __init__(self, agents, cost: CostModel, overhead_s: float):
        self.agents, self.cost, self.overhead_s = agents, cost, overhead_s
        self.events: list = []  # (time, priority 0 arrival or wake-up (task None) / 1 free, seq, rank, task)
        self.seq, self.now = 0, 0.0
        self.busy_until = [0.0] * len(agents)
        self.idle_since: list[float | None] = [0.0] * len(agents)
        self.spans: list[Span] = []
        specs = {j.rank: j for j in cost.jitter}
        self.jitter = {r: (random.Random(f"{j.seed}:{r}"), j.max_factor) for r, j in specs.items()}

    def wake(self, t: float, rank: int) -> None:
        """Make `rank` decide again at time t (a rendezvous completing)."""
        self._push(t, 0, rank, None)

    def _push(self, t: float, priority: int, rank: int, task: Action | None) -> None:
        heapq.heappush(self.events, (t, priority, self.seq, rank, task))
        self.seq += 1

    def _duration(self, rank: int, task: Action) -> float:
        seconds = self.cost.task_s(rank, task, getattr(self.agents[rank], "split_backward", False))
        if rank in self.jitter:
            rng, top = self.jitter[rank]
            seconds *= rng.uniform(1.0, top)
        return seconds + self.overhead_s + self.cost.task_overhead_of(rank)

    def _try_start(self, rank: int, now: float) -> None:
        agent = self.agents[rank]
        if self.idle_since[rank] is None or agent.done:
            return
        decision = agent.decide()
        if decision is None:
            return
        agent.start(decision.task)
        end = now + self._duration(rank, decision.task)
        agent.observe(end - now, now - self.idle_since[rank])
        self.idle_since[rank] = None
        shown = decision.task
        if getattr(agent, "split_backward", False) and shown.kind is ActionKind.BACKWARD:  # it ran as I
            shown = Action(ActionKind.BACKWARD_INPUT, shown.chunk, shown.microbatch)
        self.spans.append(Span(rank, shown, now, end, decision))
        self._push(end, 1, rank, decision.task)

    def run(self) -> float:
        for rank in range(len(self.agents)):
            self._try_start(rank, 0.0)
        now = 0.0
        while self.events:
            now = self.now = self.events[0][0]
            while self.events and self.events[0][0] == now:  # every event of this instant first
                _, priority, _, rank, task = heapq.heappop(self.events)
                if priority == 0:
                    if task is not None:
                        self.agents[rank].add_input(task)
                    continue
                consumer = self.agents[rank].finish(task)
                if consumer is not None:
                    self._push(now + self.cost.transfer_s(rank, consumer[0]), 0, consumer[0], consumer[1])
                self.idle_since[rank] = now
            for rank in range(len(self.agents)):
                self._try_start(rank, now)
        stuck = [r for r, a in enumerate(self.agents) if not a.done]
        if stuck:
            raise RuntimeError(f"simulation deadlocked: pp ranks {stuck} have tasks left and nothing arrives")
        return now


def simulate(
    pp_size: int,
    num_chunks: int,
    num_microbatches: int,
    cost: CostModel,
    *,
    schedule: PipelineSchedule | None = None,
    traversal: str | None = None,
    caps: list[int] | None = None,
    static_comm: str = "eager",
    split_backward: bool = False,
) -> SimResult:
    """Simulate one step of a static `schedule` (its comm modelled as `static_comm`, see
    static_agents.py) or of the dynamic `traversal` under `caps` (per rank), with W filling
    when `split_backward` (scheduler.py)."""
    if (schedule is None) == (traversal is None):
        raise ValueError("simulate needs exactly one of schedule= or traversal=")
    if schedule is not None:
        agents, hub = build_static_agents(schedule, static_comm, cost.transfer_s)
        return simulate_agents(agents, cost, hub=hub)
    caps = caps or [num_chunks * num_microbatches] * pp_size  # no cap
    agents = [
        RankScheduler(
            p,
            pp_size,
            num_chunks,
            num_microbatches,
            caps[p],
            build_policy(traversal, p, pp_size, num_chunks, num_microbatches),
            split_backward,
        )
        for p in range(pp_size)
    ]
    return simulate_agents(agents, cost, cost.decision_s)


def simulate_agents(agents: list, cost: CostModel, decision_s: float = 0.0, hub=None) -> SimResult:
    """Simulate one step of ranks given as scheduler objects (RankScheduler or any object with
    its interface: done, decide, start, finish, add_input, observe, counter); `hub`: the
    rendezvous hub of static agents that exchange messages through it."""
    sim = _Simulation(agents, cost, decision_s)
    if hub is not None:
        hub.wake, hub.now = sim.wake, lambda: sim.now
    makespan = sim.run()
    if hub is not None and hub.posted:
        raise RuntimeError(f"simulation ended with {len(hub.posted)} unmatched sends/recvs")
    busy = sum(s.end_s - s.start_s for s in sim.spans)
    return SimResult(
        makespan,
        1.0 - busy / (len(agents) * makespan) if makespan else 0.0,
        [a.counter.peak_microbatches for a in agents],
        [a.counter.peak_activations for a in agents],
        sim.spans,
    )
