"""Truncated rank files reported as one-line notes, for every command that reads traces."""

from __future__ import annotations

import contextlib
import sys
import warnings
from collections.abc import Iterator

from megatronapp.scan.record.format import TraceTruncatedWarning


@contextlib.contextmanager
def truncated_traces_as_notes(out=None) -> Iterator[None]:
    """Inside the block, a truncated rank file (TraceTruncatedWarning) is not a Python warning
    with its source line: each file gets one line `note: FILE: ...` on `out` (stdout by default),
    printed after the block, ahead of the command's own report."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", TraceTruncatedWarning)
        try:
            yield
        finally:
            notes = [w for w in caught if issubclass(w.category, TraceTruncatedWarning)]
            others = [w for w in caught if not issubclass(w.category, TraceTruncatedWarning)]
    for w in others:  # any other warning goes on as it came
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    by_file = {}  # the merge and the analysis may both read a file: one note for it
    for w in notes:
        text = " ".join(str(w.message).split())
        by_file.setdefault(text.split(": ", 1)[0], text)
    for text in by_file.values():
        print(f"note: {text}", file=out or sys.stdout)
