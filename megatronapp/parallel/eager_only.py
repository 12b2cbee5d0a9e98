"""`eager_only(fn)`: `torch.compiler.disable(fn)` without importing TorchDynamo to declare it.

`torch.compiler.disable` imports TorchDynamo at decoration time: about 2 s of CPU, as much as
importing torch itself. The modules that keep communication and keyed dropout outside compiled
regions are imported by every rank and every `megatronapp` command, and most of those never
compile. So the mark is made the way TorchDynamo reads it, and the real `torch.compiler.disable`
is applied on the first call after TorchDynamo has been imported:

- traced inside a compiled region, a call to the wrapper is a graph break, as it is for a
  function wrapped by `torch.compiler.disable` (TorchDynamo refuses to inline a function whose
  `_torchdynamo_disable` attribute is set);
- run, the wrapper calls `torch.compiler.disable(fn)` once TorchDynamo is loaded (so nothing
  `fn` calls is compiled), and `fn` itself before that: no compiled region can exist then;
- `prepare_compile()`, called before `torch.compile`, tells TorchDynamo never to compile the
  wrapper's own frame (the frames of `torch.compiler.disable`'s wrapper are skipped the same way,
  being torch's own code).

tests/parallel/test_eager_only.py checks the three against TorchDynamo as installed.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import TypeVar

import torch

F = TypeVar("F", bound=Callable)


def eager_only(fn: F) -> F:
    disabled = None

    @functools.wraps(fn)
    def call(*args, **kwargs):
        nonlocal disabled
        if "torch._dynamo" not in sys.modules:
            return fn(*args, **kwargs)
        if disabled is None:
            disabled = torch.compiler.disable(fn)
        return disabled(*args, **kwargs)

    call._torchdynamo_disable = True
    return call  # type: ignore[return-value]


def prepare_compile() -> None:
    """Before `torch.compile`: TorchDynamo does not compile the frames of `eager_only` wrappers."""
    from torch._dynamo.eval_frame import skip_code

    skip_code(eager_only(lambda: None).__code__)  # every wrapper shares this one code object
