"""Pictures of a schedule: a Gantt chart (PNG, matplotlib) and a Chrome/Perfetto trace (JSON).

Input is a list of `simulator.Span` (simulated or read back from a MegaScan trace). Data in,
files out; both written atomically (temp file + os.replace).
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from megatronapp.dpp.sim.simulator import Span
from megatronapp.dpp.tasks import FORWARD, WEIGHT_GRAD
from megatronapp.files import atomic_path, write_bytes_atomic
from megatronapp.pipeline.actions import ActionKind

_CATEGORY = {
    ActionKind.FORWARD: "forward",
    ActionKind.BACKWARD: "backward",
    ActionKind.BACKWARD_INPUT: "backward_input",
    ActionKind.BACKWARD_WEIGHT: "weight_grad",
}


def _label(span: Span) -> str:
    return f"{span.task.kind.value}{span.task.chunk}.{span.task.microbatch}"


def build_chrome_trace(spans: Sequence[Span], title: str) -> dict:
    """Chrome trace events: one process per pipeline rank, one complete event per task (times in us)."""
    events = [
        {"ph": "M", "name": "process_name", "pid": r, "args": {"name": f"pp rank {r}"}}
        for r in sorted({s.pp_rank for s in spans})
    ]
    for s in spans:
        args = {"chunk": s.task.chunk, "microbatch": s.task.microbatch}
        if s.decision is not None:
            args.update(
                policy=s.decision.policy,
                in_flight=s.decision.in_flight,
                ready=" ".join(f"{t.kind.value}{t.chunk}.{t.microbatch}" for t in s.decision.ready),
            )
        events.append(
            {
                "ph": "X",
                "name": _label(s),
                "cat": _CATEGORY[s.task.kind],
                "pid": s.pp_rank,
                "tid": 0,
                "ts": s.start_s * 1e6,
                "dur": (s.end_s - s.start_s) * 1e6,
                "args": args,
            }
        )
    return {"traceEvents": events, "otherData": {"title": title}}


def save_chrome_trace(spans: Sequence[Span], path: str, title: str = "schedule") -> None:
    data = json.dumps(build_chrome_trace(spans, title)).encode()
    write_bytes_atomic(path, data)


def save_gantt_png(spans: Sequence[Span], path: str, title: str = "schedule") -> None:
    """One row per pipeline rank; colour = chunk, light = forward, dark = backward (B, or I of a
    split backward), hatched = W (weight gradients); label F/B/I/W chunk.mb."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ranks = sorted({s.pp_rank for s in spans})
    end = max((s.end_s for s in spans), default=1.0)
    fig, ax = plt.subplots(figsize=(min(40, 6 + len(spans) / max(1, len(ranks)) * 0.45), 0.9 + 0.6 * len(ranks)))
    palette = plt.get_cmap("tab10")
    for s in spans:
        colour = palette(s.task.chunk % 10)
        forward = s.task.kind is FORWARD
        weight = s.task.kind is WEIGHT_GRAD
        ax.barh(
            s.pp_rank,
            s.end_s - s.start_s,
            left=s.start_s,
            height=0.8,
            color=colour,
            alpha=0.45 if forward else 0.7 if weight else 0.95,
            edgecolor="black",
            linewidth=0.3,
            hatch="//" if weight else None,
        )
        if (s.end_s - s.start_s) / end > 0.012:
            ax.text((s.start_s + s.end_s) / 2, s.pp_rank, _label(s), ha="center", va="center", fontsize=6)
    ax.set_yticks(ranks, [f"pp {r}" for r in ranks])
    ax.invert_yaxis()
    ax.set_xlim(0, end)
    ax.set_xlabel("seconds")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)
