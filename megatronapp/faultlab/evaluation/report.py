"""Tables and a chart of held-out detection scores (from injected.compute_scores)."""

from __future__ import annotations

from pathlib import Path

from megatronapp.faultlab.evaluation.injected import FAULT_KINDS

_KIND_LABEL = {
    "compute": "constant compute 1.2-2x",
    "intermittent": "intermittent compute (1 in 2-4)",
    "link": "slow link 2-50 ms",
    "two_faults": "compute + link at once",
}


def format_rate(r: dict) -> str:
    """'0.967 [0.833, 0.994] (29/30)', or 'n/a (0 runs)'."""
    if not r["n"]:
        return "n/a (0)"
    lo, hi = r["ci95"]
    return f"{r['value']:.3f} [{lo:.3f}, {hi:.3f}] ({r['k']}/{r['n']})"


def render_markdown(scores: dict, layouts: dict, header: dict) -> str:
    """The summary as markdown: provenance lines, then per-kind, per-cause and per-layout tables.
    Brackets are 95% Wilson intervals; (k/n) the counts they come from."""
    lines = [f"# MegaScan held-out detection: {header['file']}", ""]
    lines += [f"* {k}: {v}" for k, v in header.items() if k != "file"]
    lines += [
        "",
        "| fault kind | runs | recall | precision | root cause, no victim named |",
        "| --- | --- | --- | --- | --- |",
    ]
    for kind in FAULT_KINDS:
        s = scores[kind]
        lines.append(
            f"| {_KIND_LABEL[kind]} | {s['recall']['n']} | {format_rate(s['recall'])} | "
            f"{format_rate(s['precision'])} | {format_rate(s['root_cause_accuracy'])} |"
        )
    fa = scores["none"]["false_alarm_rate"]
    lines.append(f"| clean (no fault) | {fa['n']} | | | false alarms {format_rate(fa)} |")
    lines += ["", "| verdict (all runs) | recall | precision |", "| --- | --- | --- |"]
    for cause in ("slow_compute", "slow_link"):
        s = scores[cause]
        lines.append(f"| {cause} | {format_rate(s['recall'])} | {format_rate(s['precision'])} |")
    lines += [
        "",
        "| layout | root cause, no victim named (fault runs) | false alarms (clean runs) |",
        "| --- | --- | --- |",
    ]
    for layout, s in layouts.items():
        lines.append(f"| {layout} | {format_rate(s['root_cause_accuracy'])} | {format_rate(s['false_alarm_rate'])} |")
    return "\n".join(lines) + "\n"


def plot_scores(scores: dict, title: str, path: Path) -> None:
    """Point + Wilson-interval chart: recall / precision / root-cause accuracy per fault kind, and
    the clean runs' false-alarm rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = (("recall", "recall"), ("precision", "precision"), ("root_cause_accuracy", "root cause only"))
    rows = [
        (f"{_KIND_LABEL[k]}\n(n={scores[k]['recall']['n']})", [scores[k][m] for m, _ in metrics]) for k in FAULT_KINDS
    ]
    fig, ax = plt.subplots(figsize=(9, 4.8))
    for j, (_, label) in enumerate(metrics):
        xs, ys, err = [], [], [[], []]
        for i, (_, rates) in enumerate(rows):
            r = rates[j]
            if r["n"]:
                xs.append(i + (j - 1) * 0.22)
                ys.append(r["value"])
                err[0].append(r["value"] - r["ci95"][0])
                err[1].append(r["ci95"][1] - r["value"])
        ax.errorbar(xs, ys, yerr=err, fmt="o", capsize=4, label=label)
    fa = scores["none"]["false_alarm_rate"]
    if fa["n"]:
        ax.errorbar(
            [len(rows)],
            [fa["value"]],
            yerr=[[fa["value"] - fa["ci95"][0]], [fa["ci95"][1] - fa["value"]]],
            fmt="s",
            color="crimson",
            capsize=4,
            label="false-alarm rate",
        )
    ax.set_xticks(range(len(rows) + 1), [r[0] for r in rows] + [f"clean\n(n={fa['n']})"], fontsize=8)
    ax.set_ylim(-0.03, 1.03)
    ax.axhline(0.95, color="grey", lw=0.6, ls="--")
    ax.axhline(0.9, color="grey", lw=0.6, ls=":")
    ax.set_ylabel("rate (95% Wilson interval)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="center left")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp.png")
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    tmp.replace(path)
