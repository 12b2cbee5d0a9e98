"""One way to wrap torch.distributed's functions: a layer of wrappers installed over both of its
public homes (torch.distributed and distributed_c10d), restored by `uninstall()`, with a
per-thread guard so a wrapper's own calls into torch (and other layers' wrappers under it) pass
through untouched.

Two layers use it, in this order: the CPU link-delay injector (injection/link_delay.py, below)
and MegaScan's recorder (scan/record/instrument.py, above, so its spans see a delayed arrival as
they would see a slow link's).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

MODULES = (dist, c10d)


class DistributedPatch:
    """The installed wrappers of one layer; `uninstall()` restores what it replaced."""

    def __init__(self) -> None:
        self._inside = threading.local()
        self._originals: dict[tuple[Any, str], Callable] = {}

    def inside(self) -> bool:
        """True while this thread is in a call made through `call` (a nested, internal call)."""
        return getattr(self._inside, "depth", 0) > 0

    def call(self, fn: Callable, *args: Any, **kwargs: Any) -> Any:
        """fn(*args, **kwargs), with this layer's wrappers passing through while it runs."""
        self._inside.depth = getattr(self._inside, "depth", 0) + 1
        try:
            return fn(*args, **kwargs)
        finally:
            self._inside.depth -= 1

    def replaced(self, name: str) -> Callable | None:
        """What this layer's wrapper of c10d's `name` replaced (None when not installed)."""
        return self._originals.get((c10d, name))

    def patch(self, wrappers: dict[str, Callable]) -> None:
        """Install name -> wrapper in every module that has the name."""
        for module in MODULES:
            for name, wrapper in wrappers.items():
                if hasattr(module, name):
                    self._originals[module, name] = getattr(module, name)
                    setattr(module, name, wrapper)

    def uninstall(self) -> None:
        """Restore the replaced functions; idempotent."""
        for (module, name), original in self._originals.items():
            setattr(module, name, original)
        self._originals.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.uninstall()
