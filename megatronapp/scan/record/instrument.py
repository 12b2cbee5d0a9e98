"""Record every torch.distributed communication call as a MegaScan comm span.

`install_distributed_instrumentation(tracer)` replaces the public communication
functions of `torch.distributed` (and the same names in `distributed_c10d`, which
torch's own helpers and `P2POp` validation look up) with thin wrappers, so any
PyTorch program is traced without changes. Every wrapper always counts sequence
numbers — per process-group key for collectives, per directed (src, dst) pair for
p2p — because merge/detect pair events across ranks by them, and a rank must not
lose count on untraced iterations. A span is recorded only while the tracer is
active. Async calls (async_op=True, isend/irecv, batch_isend_irecv) return a
`TracedWork` whose `wait()` ends the span; everything else is delegated.

Calls made from inside a wrapped call (send -> isend, batch_isend_irecv -> isend)
are passed straight through, so each user-visible call is counted once.

Limits: only the Python API is seen (functional collectives are not; DDP's C++ reducer
only through the comm hook that zero-code tracing installs, see autotrace.py); `isinstance(work, torch.distributed.Work)` is False for a wrapped Work; a
`P2POp` built while instrumented holds the wrapper as its op and should not be
reused after uninstalling.
"""

from __future__ import annotations

import functools
import inspect
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from megatronapp import spans as S
from megatronapp.distributed_patch import MODULES as _MODULES
from megatronapp.distributed_patch import DistributedPatch
from megatronapp.scan.record.tracer import NOOP_SPAN

# Wrapped function -> (op name in the trace, name of the argument whose bytes count).
COLLECTIVES = {
    "all_reduce": (S.ALL_REDUCE, "tensor"),
    "all_gather": (S.ALL_GATHER, "tensor"),
    "all_gather_into_tensor": (S.ALL_GATHER, "input_tensor"),
    "all_gather_single": (S.ALL_GATHER, "input_tensor"),  # newer name of the above
    "reduce_scatter_single": (S.REDUCE_SCATTER, "input"),
    "reduce_scatter": (S.REDUCE_SCATTER, "input_list"),
    "reduce_scatter_tensor": (S.REDUCE_SCATTER, "input"),
    "broadcast": (S.BROADCAST, "tensor"),
    "barrier": (S.BARRIER, None),
    "all_to_all_single": (S.ALL_TO_ALL, "input"),
    "all_to_all": (S.ALL_TO_ALL, "input_tensor_list"),
}
P2P = {"send": S.SEND, "recv": S.RECV, "isend": S.SEND, "irecv": S.RECV}
# Only the names this torch version has (the *_single ones are recent).
_WRAPPED = tuple(n for n in (*COLLECTIVES, *P2P, "batch_isend_irecv") if hasattr(c10d, n))
_MARK = "__megascan_original__"


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


def _arg(fn_params: dict, args: tuple, kwargs: dict, name: str, default: Any = None) -> Any:
    """Argument `name` of a call, whether passed by position or keyword."""
    if name in kwargs:
        return kwargs[name]
    index = fn_params.get(name)
    return args[index] if index is not None and index < len(args) else default


class TracedWork:
    """A Work whose `wait()` also ends the comm spans of the call that returned it.

    `add_wait_hook(fn)` runs `fn()` after the transfer completed and before the span ends:
    fault injection uses it to make a message complete later, inside its recv span."""

    __slots__ = ("_work", "_done", "_hooks")

    def __init__(self, work: Any, done: Callable[[], None]) -> None:
        self._work, self._done, self._hooks = work, done, []

    def add_wait_hook(self, fn: Callable[[], None]) -> None:
        self._hooks.append(fn)

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        result = self._work.wait(*args, **kwargs)
        for hook in self._hooks:
            hook()
        self._done()
        return result

    def get_future(self) -> Any:
        """The Work's future; the spans end when it completes, for callers that never wait()
        (DDP comm hooks, FSDP2 on some paths)."""
        future = self._work.get_future()
        future.add_done_callback(lambda _: self._done())
        return future

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


def _finisher(spans: list, parts: int) -> Callable[[], None]:
    """Callback ending `spans` once it has been called `parts` times (once per Work; later
    calls, e.g. wait() after the future completed, change nothing)."""
    remaining = [parts]

    def done() -> None:
        remaining[0] -= 1
        if remaining[0] == 0:
            for span in spans:
                span.finish()

    return done


@dataclass
class _Counters:
    """Sequence numbers; they advance on every call, traced or not."""

    collective: dict = field(default_factory=lambda: defaultdict(int))
    p2p: dict = field(default_factory=lambda: defaultdict(int))
    group_keys: dict = field(default_factory=dict)

    def next_collective(self, key: str) -> int:
        seq = self.collective[key]
        self.collective[key] = seq + 1
        return seq

    def next_p2p(self, src: int, dst: int) -> int:
        seq = self.p2p[src, dst]
        self.p2p[src, dst] = seq + 1
        return seq


def compute_group_key(group_name: str, ranks: list[int]) -> str:
    """Process-group key used in traces: "NAME:[r0,r1,...]", identical on all members."""
    return f"{group_name}:[{','.join(str(r) for r in ranks)}]"


class DistributedInstrumentation(DistributedPatch):
    """The installed wrappers of one tracer; `uninstall()` restores torch.distributed."""

    def __init__(self, tracer: Any) -> None:
        super().__init__()
        self.tracer = tracer
        self.rank = int(tracer.meta["rank"])
        self.counters = _Counters()

    # ----- lookups -------------------------------------------------------------
    def group_key(self, group: Any) -> str:
        group = group if group is not None else c10d._get_default_group()
        key = self.counters.group_keys.get(group)
        if key is None:
            key = compute_group_key(group.group_name, dist.get_process_group_ranks(group))
            self.counters.group_keys[group] = key
        return key

    def _end(self, spans: list, result: Any, is_async: bool) -> Any:
        """End spans now, or when the returned Work(s) are waited on."""
        if all(span is NOOP_SPAN for span in spans):
            return result  # untraced iteration: hand back torch's own objects
        if is_async and isinstance(result, list) and result:
            if len(result) == len(spans):  # one Work per op: time each op on its own
                return [TracedWork(w, _finisher([s], 1)) for w, s in zip(result, spans)]
            done = _finisher(spans, len(result))  # coalesced: spans end with the last Work
            return [TracedWork(w, done) for w in result]
        if is_async and result is not None and not isinstance(result, list):
            return TracedWork(result, _finisher(spans, 1))
        for span in spans:
            span.finish()
        return result

    # ----- wrappers ------------------------------------------------------------
    def wrap_collective(self, fn_name: str, original: Callable) -> Callable:
        op, bytes_arg = COLLECTIVES[fn_name]
        params = {p: i for i, p in enumerate(inspect.signature(original).parameters)}

        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            group = _arg(params, args, kwargs, "group")
            if self.inside() or group is dist.GroupMember.NON_GROUP_MEMBER:
                return original(*args, **kwargs)
            key = self.group_key(group)
            seq = self.counters.next_collective(key)
            nbytes = _nbytes(_arg(params, args, kwargs, bytes_arg)) if self.tracer.active and bytes_arg else 0
            span = self.tracer.record_comm(op, group=key, seq=seq, bytes=nbytes)
            result = self.call(original, *args, **kwargs)
            return self._end([span], result, bool(_arg(params, args, kwargs, "async_op", False)))

        return wrapper

    def _global_peer(self, group: Any, peer: Any, group_peer: Any) -> int:
        if peer is not None:
            return int(peer)
        if group_peer is not None:
            return dist.get_global_rank(group if group is not None else c10d._get_default_group(), group_peer)
        return -1  # recv from any source

    def wrap_p2p(self, fn_name: str, original: Callable) -> Callable:
        op = P2P[fn_name]
        is_async = fn_name.startswith("i")
        peer_arg = "dst" if op == S.SEND else "src"
        params = {p: i for i, p in enumerate(inspect.signature(original).parameters)}

        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if self.inside():
                return original(*args, **kwargs)
            group = _arg(params, args, kwargs, "group")
            peer = self._global_peer(
                group, _arg(params, args, kwargs, peer_arg), _arg(params, args, kwargs, "group_" + peer_arg)
            )
            seq = -1 if peer < 0 else self.counters.next_p2p(*self._pair(op, peer))
            active = self.tracer.active
            span = self.tracer.record_comm(
                op,
                group=self.group_key(group) if active else "",
                seq=seq,
                peer=peer,
                bytes=_nbytes(_arg(params, args, kwargs, "tensor")) if active else 0,
            )
            result = self.call(original, *args, **kwargs)
            if op == S.RECV and not is_async and peer < 0 and isinstance(result, int) and result >= 0:
                # recv from any source: the sender is known only now.
                self.counters.next_p2p(result, self.rank)
            return self._end([span], result, is_async)

        return wrapper

    def _pair(self, op: str, peer: int) -> tuple[int, int]:
        return (self.rank, peer) if op == S.SEND else (peer, self.rank)

    def wrap_batch(self, original: Callable) -> Callable:
        @functools.wraps(original)
        def wrapper(p2p_op_list: list) -> Any:
            if self.inside():
                return original(p2p_op_list)
            spans, restore = [], []
            for p2p_op in p2p_op_list:
                op = self._p2p_op_kind(p2p_op.op)
                seq = self.counters.next_p2p(*self._pair(op, p2p_op.peer))
                if self.tracer.active:
                    spans.append(
                        self.tracer.record_comm(
                            op,
                            group=self.group_key(p2p_op.group),
                            seq=seq,
                            peer=p2p_op.peer,
                            bytes=_nbytes(p2p_op.tensor),
                        )
                    )
                # torch tells sends from recvs by `op is isend` against the module global,
                # which is our wrapper now; ops built before install hold the original.
                current = getattr(c10d, "isend" if op == S.SEND else "irecv")
                restore.append((p2p_op, p2p_op.op))
                p2p_op.op = current
            try:
                result = self.call(original, p2p_op_list)
            finally:
                for p2p_op, fn in restore:
                    p2p_op.op = fn
            return self._end(spans, result, True) if spans else result

        return wrapper

    def _p2p_op_kind(self, fn: Callable) -> str:
        original = getattr(fn, _MARK, fn)
        for name in ("isend", "irecv"):
            if original is (self.replaced(name) or getattr(c10d, name)):
                return P2P[name]
        raise ValueError(f"P2POp op {fn!r} is neither torch.distributed.isend nor irecv")

    # ----- install -------------------------------------------------------------
    def install(self) -> None:
        if hasattr(dist.all_reduce, _MARK):
            raise RuntimeError("MegaScan distributed instrumentation is already installed; uninstall it first")
        wrappers: dict[str, Callable] = {}
        for name in _WRAPPED:
            original = getattr(c10d, name)
            if name in COLLECTIVES:
                wrapper = self.wrap_collective(name, original)
            elif name in P2P:
                wrapper = self.wrap_p2p(name, original)
            else:
                wrapper = self.wrap_batch(original)
            setattr(wrapper, _MARK, original)
            wrappers[name] = wrapper
        self.patch(wrappers)


def install_distributed_instrumentation(tracer: Any) -> DistributedInstrumentation | None:
    """Wrap torch.distributed's communication functions to record comm spans on `tracer`.

    Returns the installation (call `.uninstall()` or use it as a context manager), or
    None without touching torch when the tracer is disabled (zero cost). Raises
    RuntimeError if an instrumentation is already installed."""
    if not tracer.enabled:
        return None
    instrumentation = DistributedInstrumentation(tracer)
    instrumentation.install()
    return instrumentation


def uninstall_distributed_instrumentation() -> bool:
    """Restore torch.distributed whatever installation wrapped it; True if one was."""
    found = False
    for module in _MODULES:
        for name in _WRAPPED:
            original = getattr(getattr(module, name, None), _MARK, None)
            if original is not None:
                setattr(module, name, original)
                found = True
    return found
