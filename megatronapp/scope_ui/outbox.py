"""What the server queues for a tab, and how a backlog is coalesced before it is sent.

The model side (generation or training thread) only builds small `TokenOut` / `ViewOut`
records and protocol messages and posts them; encoding (JSON, token texts, binary frames)
happens on the server's event-loop thread, per tab, when the tab can take more. A tab that
falls behind gets its backlog coalesced by `coalesce` (a pure function):

    - tokens are never dropped: every TokenOut of a stretch goes out, in order, in ONE
      `tokens` message;
    - view updates (tensor rows of a run) of the same (run, site, layer) are merged into one
      frame (rows concatenated, attention key columns padded with zeros); probe frames
      (training) replace each other, so only the newest per (site, layer) goes;
    - generation views of a layer the tab no longer shows are dropped;
    - any other message is a barrier: nothing is moved across it (a run's frames never mix
      with the next run's), and it keeps its place.
Within a stretch between barriers the merged view frames go first, then the tokens (the page
redraws on tokens, so the rows are there when it does).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from megatronapp.scope_ui import protocol as P

TOKEN_AXIS = {"attn_probs": 2, "residual": 1}  # (B, heads, S, T) / (B, S, W): the row (token) dim


@dataclass(frozen=True)
class TokenOut:
    """One generated token; texts are looked up when it is encoded."""

    run: str
    step: int
    id: int
    topk: tuple[tuple[int, float], ...]  # (id, probability)
    lens: tuple[tuple[int, float], ...]  # per layer: (top id, probability)
    t_server_ms: float


@dataclass(frozen=True)
class ViewOut:
    """Rows `start ..` of one layer's site in a run (`data` C-order, token dim per TOKEN_AXIS)."""

    run: str  # "clean" | "perturbed" | "probe"
    step: int  # newest step in `data`
    site: str
    layer: int
    start: int  # index of the first row (position) in `data`
    dims: tuple[str, ...]
    compression: tuple = field(default=())
    data: np.ndarray = field(default=None, repr=False)

    @property
    def key(self) -> tuple:
        return (self.run, self.site, self.layer)

    @property
    def rows(self) -> int:
        return self.data.shape[TOKEN_AXIS[self.site]]


def merge_views(a: ViewOut, b: ViewOut) -> ViewOut | None:
    """`a` followed by the later `b` of the same key: a's rows before b.start, then b's rows
    (b alone when it starts at or before a, as a refill or a probe does); None when b starts
    after a's last row (nothing is invented for the gap)."""
    if b.run == "probe" or b.start <= a.start:
        return b
    if b.start > a.start + a.rows:
        return None
    axis = TOKEN_AXIS[a.site]
    keep = np.take(a.data, np.arange(b.start - a.start), axis=axis)
    parts = [keep, b.data]
    if a.site == "attn_probs":  # keys grow with the rows: pad the shorter maps with zeros
        width = max(p.shape[-1] for p in parts)
        parts = [np.pad(p, [(0, 0)] * (p.ndim - 1) + [(0, width - p.shape[-1])]) for p in parts]
    return replace(b, start=a.start, data=np.concatenate(parts, axis=axis))


def coalesce(items: list, layer: int | None = None) -> list:
    """The backlog `items` (TokenOut, ViewOut, protocol messages) as few frames as it can be
    (rules in the module docstring); `layer` is the tab's shown layer (None: keep every layer)."""
    out, views, tokens = [], {}, []

    def flush() -> None:
        out.extend(views.values())
        if tokens:
            out.append(list(tokens))
        views.clear()
        tokens.clear()

    for item in items:
        if isinstance(item, TokenOut):
            tokens.append(item)
        elif isinstance(item, ViewOut):
            if layer is not None and item.run != "probe" and item.layer != layer:
                continue
            merged = merge_views(views[item.key], item) if item.key in views else item
            if merged is None:
                out.append(views.pop(item.key))
                merged = item
            views[item.key] = merged
        else:
            flush()
            out.append(item)
    flush()
    return out


def encode(item, decode) -> str | bytes:
    """The wire frame of one coalesced item; `decode(id) -> text` for token texts."""
    if isinstance(item, list):  # a stretch of TokenOut
        return P.Tokens(tokens=[_token(t, decode) for t in item]).model_dump_json()
    if isinstance(item, ViewOut):
        data = np.ascontiguousarray(item.data)
        header = P.TensorHeader(
            run=item.run,
            step=item.step,
            site=item.site,
            layer=item.layer,
            start=item.start,
            dims=list(item.dims),
            dtype=str(data.dtype),
            shape=list(data.shape),
            compression=list(item.compression),
        )
        return P.encode_tensor_frame(header, data.tobytes())
    return item.model_dump_json()


def _token(t: TokenOut, decode) -> P.Token:
    entries = lambda pairs: [P.TopEntry(id=i, text=decode(i), p=p) for i, p in pairs]
    return P.Token(
        run=t.run,
        step=t.step,
        id=t.id,
        text=decode(t.id),
        topk=entries(t.topk),
        lens=entries(t.lens),
        t_server_ms=t.t_server_ms,
    )
