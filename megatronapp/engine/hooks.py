"""What the engine expects from an observer (a tracer), and a do-nothing default.

The engine never imports a module such as MegaScan: the CLI builds a tracer that implements
this small protocol and hands it to the trainer.
"""

from __future__ import annotations

import contextlib

_NULL_CONTEXT = contextlib.nullcontext()


class NullTracer:
    """Tracing disabled: every hook is a no-op that allocates nothing."""

    enabled = False

    def span(self, name: str, cat: str = "compute", **attrs):
        return _NULL_CONTEXT

    def layer_span(self, name: str, layer: int, **attrs):
        return _NULL_CONTEXT

    def context(self, **attrs):
        return _NULL_CONTEXT

    def step_begin(self, iteration: int) -> None:
        """Begin an optimizer step; a real tracer opens the step's "iteration" span here."""

    def step_end(self, iteration: int) -> None:
        pass

    def mark_iteration(self, iteration: int, label: str, **attrs) -> None:
        """Mark `iteration` on the timeline (e.g. label "rerun", attrs verdict and flag): a
        real tracer records an instant event; called after the iteration's steps ran."""

    def close(self) -> None:
        pass


NULL_TRACER = NullTracer()
