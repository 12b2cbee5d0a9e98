"""Zero-code tracing: record an unmodified PyTorch program's iterations, compute and communication.

`AutoTrace.start(config)` installs, in this order (and `close()` removes them in reverse):

  1. link delays from MEGATRONAPP_INJECT_LINK_DELAY (injection.link_delay; below the tracer so
     traced recv spans see the late arrival);
  2. the tracer and the torch.distributed instrumentation (instrument.py): every Python-level
     collective and p2p call, which includes FSDP2's all-gathers and reduce-scatters;
  3. DDP: at a DDP module's first forward, if the program registered no comm hook of its own,
     torch's stock `allreduce_hook` (the same averaging all-reduce the C++ reducer does), so its
     gradient buckets go through the instrumented `dist.all_reduce`;
  4. module hooks (global): the outermost module call of each forward is a "forward" span, each
     `torch.autograd.backward` (so `loss.backward()`) a "backward" span, both keyed by their
     index in the iteration (microbatch). Granularity "full" adds one span per module forward
     and backward (name = module class, layer = nesting depth, op = module_forward/backward).
     A slowdown from MEGATRONAPP_INJECT_SLOWDOWN stretches those forward/backward spans;
  5. iteration boundaries: an optimizer step (a global optimizer step post-hook) ends the
     iteration when the next forward or backward begins (so several optimizers stepping in a
     row count once), unless the program calls `megatronapp.scan.step()`, which then is the only
     boundary. The unfinished tail after the last step is dropped at close;
  6. the link probe (scan/probe_job.py), untraced, when the program destroys its default process
     group or, if it never does, at close: under `probe` "auto" only where some rank sent a
     point-to-point message, and never after the program failed (its peers may not get there).

Ranks are taken as data-parallel replicas (coords dp = rank), which is what DDP and FSDP are.
"""

from __future__ import annotations

import os
import sys
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.modules import module as nn_module
from torch.optim.optimizer import register_optimizer_step_post_hook

from megatronapp import spans as S
from megatronapp.injection.inject import FaultInjector, fault_plan_from_env
from megatronapp.injection.link_delay import install_link_delays
from megatronapp.scan.probe_job import probe_program_links
from megatronapp.scan.record.format import build_rank_meta
from megatronapp.scan.record.instrument import install_distributed_instrumentation
from megatronapp.scan.record.tracer import GRANULARITIES, TraceConfig, Tracer

ENV_PREFIX = "MEGATRONAPP_TRACE_"


@dataclass(frozen=True)
class AutoTraceConfig:
    """What `trace run` hands every rank (through MEGATRONAPP_TRACE_* variables)."""

    trace_dir: str = TraceConfig.trace_dir
    granularity: str = TraceConfig.granularity
    interval: int = TraceConfig.interval  # trace continuous_iterations iterations every interval (iteration 0 never)
    continuous_iterations: int = TraceConfig.continuous_iterations
    probe: str = TraceConfig.probe  # link probe after the last iteration: off, auto (when p2p was seen), on

    def __post_init__(self) -> None:
        if self.granularity not in GRANULARITIES:
            raise ValueError(f"trace granularity must be one of {GRANULARITIES}, got {self.granularity!r}")
        TraceConfig(
            enabled=True,
            trace_dir=self.trace_dir,
            interval=self.interval,
            continuous_iterations=self.continuous_iterations,
            probe=self.probe,
        )  # same checks as the engine's

    def to_env(self) -> dict[str, str]:
        return {
            f"{ENV_PREFIX}DIR": self.trace_dir,
            f"{ENV_PREFIX}GRANULARITY": self.granularity,
            f"{ENV_PREFIX}INTERVAL": str(self.interval),
            f"{ENV_PREFIX}CONTINUOUS": str(self.continuous_iterations),
            f"{ENV_PREFIX}PROBE": self.probe,
        }

    @classmethod
    def from_env(cls, environ: dict | None = None) -> AutoTraceConfig:
        env = os.environ if environ is None else environ
        try:
            return cls(
                env.get(f"{ENV_PREFIX}DIR", cls.trace_dir),
                env.get(f"{ENV_PREFIX}GRANULARITY", cls.granularity),
                int(env.get(f"{ENV_PREFIX}INTERVAL", cls.interval)),
                int(env.get(f"{ENV_PREFIX}CONTINUOUS", cls.continuous_iterations)),
                env.get(f"{ENV_PREFIX}PROBE", cls.probe),
            )
        except ValueError as exc:
            raise ValueError(f"bad {ENV_PREFIX}* setting: {exc}") from None


def _rank_meta(rank: int, world: int, device: Any) -> dict:
    return build_rank_meta(
        rank=rank,
        world_size=world,
        coords={"tp": 0, "dp": rank, "pp": 0},
        layout={"tp_size": 1, "pp_size": 1, "dp_size": world},
        host=os.uname().nodename,
        device=str(device),
        run_id=os.environ.get("MEGATRONAPP_RUN_ID", "local"),
        clock="cuda" if str(device).startswith("cuda") else "monotonic",
        run={
            "zero_code": True,
            "inject_slowdown": os.environ.get("MEGATRONAPP_INJECT_SLOWDOWN", ""),
            "inject_link_delay": os.environ.get("MEGATRONAPP_INJECT_LINK_DELAY", ""),
        },
    )


class AutoTrace:
    """One rank's zero-code tracing session (see the module docstring)."""

    def __init__(self, config: AutoTraceConfig, rank: int, world: int, device: Any) -> None:
        self.config, self.rank, self.world, self.device, self.iteration = config, rank, world, device, 0
        self.explicit_steps, self._boundary_pending = False, False
        plan = fault_plan_from_env()
        plan.check(world)
        self._link_delays = install_link_delays(plan, rank) if torch.device(device).type == "cpu" else None
        self.injector = FaultInjector(plan, rank, torch.device(device)) if rank in plan.slowdowns else None
        trace = TraceConfig(
            enabled=True,
            trace_dir=config.trace_dir,
            interval=config.interval,
            continuous_iterations=config.continuous_iterations,
            granularity=config.granularity,
        )
        self.tracer = Tracer(trace, _rank_meta(rank, world, device), device)
        self._instrumentation = install_distributed_instrumentation(self.tracer)
        self._depth, self._stack, self._backward_open, self._probed = 0, [], {}, False
        self._counts = {S.FORWARD: 0, S.BACKWARD: 0}
        self._handles = [
            nn_module.register_module_forward_pre_hook(self._forward_pre),
            nn_module.register_module_forward_hook(self._forward_post, always_call=True),
            register_optimizer_step_post_hook(self._optimizer_stepped),
        ]
        if config.granularity == "full":
            # A first module whose inputs need no grad (the usual data batch) triggers a torch
            # warning per hook; it is expected here, not something the program did.
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
            self._handles += [
                nn_module.register_module_full_backward_pre_hook(self._backward_pre),
                nn_module.register_module_full_backward_hook(self._backward_post),
            ]
        self._original_backward = torch.autograd.backward
        torch.autograd.backward = self._traced_backward
        self._patch_ddp()
        self._patch_destroy_process_group()
        self.tracer.step_begin(0)

    # -- iterations ------------------------------------------------------------------------
    def mark_step(self, explicit: bool = True) -> None:
        """End the current iteration and begin the next."""
        self.explicit_steps |= explicit
        self._boundary_pending = False
        self.tracer.step_end(self.iteration)
        self.iteration += 1
        self._counts = {S.FORWARD: 0, S.BACKWARD: 0}
        if self.injector is not None:
            self.injector.set_iteration(self.iteration)
        self.tracer.step_begin(self.iteration)

    def _optimizer_stepped(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._boundary_pending = not self.explicit_steps

    def _take_pending_boundary(self) -> None:
        if self._boundary_pending:
            self.mark_step(explicit=False)

    # -- compute spans ---------------------------------------------------------------------
    def _open(self, name: str, **attrs: Any) -> Any:
        span = self.tracer.span(name, **attrs)
        span.__enter__()
        return span

    def _forward_pre(self, module: Any, args: Any) -> None:
        self._depth += 1
        if self._depth == 1:
            self._take_pending_boundary()
            mb = self._counts[S.FORWARD]
            self._counts[S.FORWARD] = mb + 1
            slow = self.injector.compute(S.FORWARD) if self.injector is not None else None
            self._stack.append((self._open(S.FORWARD, microbatch=mb), slow))
            if slow is not None:
                slow.__enter__()
        else:
            self._stack.append(
                (self.tracer.layer_span(type(module).__name__, self._depth - 1, op=S.MODULE_FORWARD).__enter__(), None)
            )

    def _forward_post(self, module: Any, args: Any, output: Any) -> None:
        span, slow = self._stack.pop()
        if slow is not None:
            slow.__exit__(None, None, None)
        span.__exit__(None, None, None)
        self._depth -= 1

    def _traced_backward(self, *args: Any, **kwargs: Any) -> Any:
        self._take_pending_boundary()
        mb = self._counts[S.BACKWARD]
        self._counts[S.BACKWARD] = mb + 1
        with self.tracer.span(S.BACKWARD, microbatch=mb):
            if self.injector is None:
                return self._original_backward(*args, **kwargs)
            with self.injector.compute(S.BACKWARD):
                return self._original_backward(*args, **kwargs)

    def _backward_pre(self, module: Any, grad_output: Any) -> None:
        self._backward_open.setdefault(id(module), []).append(
            self.tracer.layer_span(type(module).__name__, 0, op=S.MODULE_BACKWARD).__enter__()
        )

    def _backward_post(self, module: Any, grad_input: Any, grad_output: Any) -> None:
        opened = self._backward_open.get(id(module))
        if opened:
            opened.pop().__exit__(None, None, None)

    # -- DDP -------------------------------------------------------------------------------
    def _patch_ddp(self) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
        from torch.nn.parallel import DistributedDataParallel

        original_init = DistributedDataParallel.__init__

        def first_forward(ddp: Any, args: Any) -> None:
            ddp._megascan_hook_handle.remove()
            if not getattr(ddp, "_comm_hooks", None):  # the program chose no hook: use the stock one
                ddp.register_comm_hook(ddp.process_group, allreduce_hook)

        def init(ddp: Any, *args: Any, **kwargs: Any) -> None:
            original_init(ddp, *args, **kwargs)
            ddp._megascan_hook_handle = ddp.register_forward_pre_hook(first_forward)

        DistributedDataParallel.__init__ = init
        self._ddp = (DistributedDataParallel, original_init)

    # -- link probe ------------------------------------------------------------------------
    def _patch_destroy_process_group(self) -> None:
        """Probe the links when the program destroys its default process group (most do), while
        the group still exists; close() probes those that never destroy it."""
        original = dist.destroy_process_group

        def destroy(group: Any = None) -> None:
            if group is None and sys.exc_info()[0] is None:  # a failing rank must not wait for its peers
                self._probe_links()
            original(group)

        dist.destroy_process_group = destroy
        self._original_destroy = original

    def _probe_links(self) -> None:
        """The link probe (scan/probe_job.py), once, untraced: the program's iterations are over."""
        if self._probed or not dist.is_initialized():
            return
        self._probed = True
        sent = set()
        if self._instrumentation is not None:
            sent = set(self._instrumentation.counters.p2p)
            self._instrumentation.uninstall()
            self._instrumentation = None
        probe_program_links(self.config.trace_dir, self.config.probe, sent, self.rank, self.world, self.device)

    # -- teardown --------------------------------------------------------------------------
    def close(self, probe: bool = True) -> None:
        """Drop the unfinished last iteration, probe the links (`probe`: the program completed),
        remove every hook and patch, close the trace."""
        self._take_pending_boundary()  # the last optimizer step completed an iteration
        self.tracer.cancel_step()
        if probe:
            self._probe_links()
        dist.destroy_process_group = self._original_destroy
        for handle in self._handles:
            handle.remove()
        torch.autograd.backward = self._original_backward
        cls, original_init = self._ddp
        cls.__init__ = original_init
        if self._instrumentation is not None:
            self._instrumentation.uninstall()
        self.tracer.close()
        if self._link_delays is not None:
            self._link_delays.uninstall()


def start_from_env() -> AutoTrace:
    """A session for this process as torchrun describes it (RANK, WORLD_SIZE, LOCAL_RANK)."""
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = f"cuda:{local}" if torch.cuda.is_available() else "cpu"
    return AutoTrace(AutoTraceConfig.from_env(), rank, world, device)
