"""Running and scoring a frozen split (frozen.py): scenario -> lab plan -> verdict -> scores.

Each scenario runs once through megatronapp.faultlab.run_lab, one at a time (the lab pins and
throttles real processes: two runs at once would be each other's fault). Its verdict comes from
the split's own thresholds; one JSON line per run is appended to SPLIT/results.jsonl at once.
"""

from __future__ import annotations

import json
import shutil
import time
from collections import defaultdict
from pathlib import Path

import megatronapp.faultlab.evaluation.frozen as frozen
from megatronapp.faultlab.evaluation.frozen import CLEAN_KINDS, ROOT, SCRIPTS, FrozenSplitError, load_split
from megatronapp.faultlab.evaluation.injected import named_causes, rate
from megatronapp.faultlab.evaluation.injected_runner import append_record, load_records

# The tiny preset's 8 KiB activations fit in a rate limiter's burst: a 20 Mbit/s link delayed them
# 0.5 ms (design split 2: both slow links missed under the 2 ms excess bar). 32 KiB messages take
# ~13 ms on it, as a real model's far larger activations would on a slow link.
ENGINE_MODEL = ("--model", "tiny", "--hidden-size", "128", "--global-batch-size", "8", "--micro-batch-size", "2")


def build_plan(sc: dict):
    """The LabPlan of a scenario (frozen.draw_scenario)."""
    from megatronapp.faultlab import EngineJob, ExtraWork, LabPlan, Noise, Schedule, ScriptJob, SlowLink, SlowRank

    job = sc["job"]
    if "script" in job:
        script, args = SCRIPTS[job["script"]]
        lab_job = ScriptJob(str(ROOT / script), args, nproc=job["nproc"])
    else:
        lab_job = EngineJob(job["tp"], job["pp"], job["dp"], iters=job.get("iters", 20), extra=ENGINE_MODEL)
    faults = []
    for f in sc["faults"]:
        if f["type"] == "extra_work":
            faults.append(ExtraWork(f["rank"], f["matmuls"]))
        elif f["type"] == "noise":
            faults.append(Noise())
        elif f["type"] == "slow_rank":
            schedule = Schedule(*f["schedule"]) if "schedule" in f else None
            faults.append(SlowRank(f["rank"], f["method"], f["factor"], schedule))
        elif f["type"] == "slow_link":
            faults.append(SlowLink(f["src"], f["dst"], f["rate_mbit"]))
    return LabPlan(lab_job, tuple(faults), nodes=sc.get("nodes", 0), tag=f"ev{sc['index']}")


def run_scenario(sc: dict, thresholds: dict, work_dir: Path, timeout_s: float, keep_traces: bool = False) -> dict:
    from megatronapp.faultlab import run_lab
    from megatronapp.scan.analyze.detect_config import DetectConfig
    from megatronapp.scan.analyze.load_align_detect import analyze_trace_dir

    run_dir = work_dir / f"run{sc['index']}"
    shutil.rmtree(run_dir, ignore_errors=True)
    plan = build_plan(sc)
    # timeout_s is for 4 ranks on the 2-core machine: 8 ranks, one of them throttled, take twice as long
    result = run_lab(plan, run_dir / "trace", timeout_s=timeout_s * max(1.0, plan.job.nproc / 4))
    record = {
        "index": sc["index"],
        "kind": sc["kind"],
        "layout": sc["layout"],
        "truth": sc["truth"],
        "applied": list(result.applied),
        "seconds": round(result.seconds, 1),
        "error": "",
        "suspects": [],
    }
    if result.returncode != 0:
        record["error"] = f"job exit {result.returncode}"
        return record
    try:  # what `trace detect` says of the run: iterations joined, the link probe read, the impact gate
        report = analyze_trace_dir(run_dir / "trace", DetectConfig(**thresholds)).detection
    except (OSError, ValueError) as exc:
        record["error"] = f"detect: {str(exc).splitlines()[0]}"
        return record
    record["suspects"] = [_named(s) for s in report.suspects]
    record["below_impact"] = [_named(s) for s in report.below_impact]  # for diagnosis; never scored
    record["links_measured"] = [dict(link) for link in report.links_measured]
    if not keep_traces and named_causes(record["suspects"]) == _truth(record):  # a wrong one stays, for diagnosis
        shutil.rmtree(run_dir, ignore_errors=True)
    return record


def rejudge_split(split_dir: Path, work_dir: Path) -> list[dict]:
    """The runs of a design split judged again, from the traces `run --keep-traces` kept, by the
    detector as it is now (its defaults): what a detector change does to runs already made. Refused
    unless every run that recorded no error kept its trace: a held-out split keeps only the traces
    it judged wrong, and is never re-scored."""
    from megatronapp.scan.analyze.load_align_detect import analyze_trace_dir

    records = load_records(Path(split_dir) / "results.jsonl")
    missing = [r["index"] for r in records if not r["error"] and not (work_dir / f"run{r['index']}" / "trace").is_dir()]
    if missing:
        raise FrozenSplitError(
            f"{len(missing)} runs of {split_dir} kept no trace under {work_dir} (run {missing[0]}): "
            "only a design split run with --keep-traces can be judged again"
        )
    out = []
    for r in records:
        if not r["error"]:
            report = analyze_trace_dir(work_dir / f"run{r['index']}" / "trace").detection
            r = {
                **r,
                "suspects": [_named(s) for s in report.suspects],
                "below_impact": [_named(s) for s in report.below_impact],
            }
        out.append(r)
    return out


def _named(suspect) -> dict:
    return {"cause": suspect.cause, "rank": suspect.rank, "link": list(suspect.link) if suspect.link else None}


def run_split(
    split_dir: Path,
    work_dir: Path,
    timeout_s: float = 150.0,
    log=print,
    resume: bool = False,
    budget_s: float = 0.0,
    keep_traces: bool = False,
) -> Path:
    """Run every scenario of a frozen split once; refused if it ran (even partly) before, unless
    `resume` (then the scenarios not yet recorded run, in the split's order), or if the working
    tree has uncommitted changes. The detector version is checked again before each run: a
    commit or a thresholds edit mid-split stops it (the split is then spent; a split run in parts
    runs from a worktree checked out at its frozen commit). `budget_s` > 0 starts no run after
    that many seconds, so a long split runs in parts. `keep_traces` keeps every run's trace (a
    design split re-judged offline while tuning), not only the wrongly judged ones."""
    split = load_split(split_dir)
    if frozen.detector_version(Path(split["thresholds_file"]))["dirty"]:
        raise FrozenSplitError("the working tree has uncommitted changes: what runs would not be what was frozen")
    results = Path(split_dir) / "results.jsonl"
    if results.exists() and not resume:
        raise FrozenSplitError(f"{split_dir} has run already ({results}): a split runs once (--resume continues it)")
    done = {r["index"] for r in load_records(results)} if results.exists() else set()
    _drop_truncated_line(results)
    start = time.monotonic()
    for sc in split["scenarios"]:
        if sc["index"] in done:
            continue
        if budget_s and time.monotonic() - start > budget_s:
            log(f"budget of {budget_s:.0f} s spent: {len(split['scenarios']) - len(done)} runs left (--resume)")
            break
        load_split(split_dir)
        t0 = time.monotonic()
        record = run_scenario(sc, split["thresholds"], Path(work_dir), timeout_s, keep_traces)
        append_record(results, record)
        done.add(sc["index"])
        log(
            f"run {sc['index']} {sc['kind']} {sc['layout']}: {record['error'] or record['suspects']} "
            f"({time.monotonic() - t0:.0f} s)"
        )
    return results


def _drop_truncated_line(results: Path) -> None:
    """Create `results`, or cut the part line a killed run left at its end (load_records skipped
    it), so the next record starts on a line of its own."""
    from megatronapp.files import write_text_atomic

    text = results.read_text() if results.exists() else ""
    if not text.endswith("\n"):
        write_text_atomic(results, text[: text.rfind("\n") + 1])


def _truth(record: dict) -> set:
    return {("slow_link", tuple(t[1])) if t[0] == "slow_link" else (t[0], t[1]) for t in record["truth"]}


def score_records(records: list[dict]) -> dict:
    """Per kind and per layout: recall (every true cause named), top-1 (the first suspect is a true
    cause), precision (named causes that are true) and, for clean kinds, false alarms."""
    groups: dict[str, dict[str, list]] = {"kind": defaultdict(list), "layout": defaultdict(list)}
    for r in records:
        if r["error"]:
            continue
        groups["kind"][r["kind"]].append(r)
        groups["layout"][r["layout"]].append(r)
    return {axis: {key: _scores(rs) for key, rs in sorted(by.items())} for axis, by in groups.items()}


def _scores(rs: list[dict]) -> dict:
    clean = [r for r in rs if r["kind"] in CLEAN_KINDS]
    faulty = [r for r in rs if r["kind"] not in CLEAN_KINDS]
    named = [(named_causes(r["suspects"]), _truth(r)) for r in faulty]
    first = [bool(r["suspects"]) and named_causes(r["suspects"][:1]) <= _truth(r) for r in faulty]
    return {
        "recall": rate(sum(t <= n for n, t in named), len(named)),
        "top1": rate(sum(first), len(first)),
        "precision": rate(sum(len(n & t) for n, t in named), sum(len(n) for n, _ in named)),
        "false_alarm": rate(sum(bool(r["suspects"]) for r in clean), len(clean)),
    }


def score_split(split_dir: Path) -> dict:
    """The split's scores with both detector hashes; refused if the detector changed since freezing."""
    split = load_split(split_dir)
    records = load_records(Path(split_dir) / "results.jsonl")
    errors = [r for r in records if r["error"]]
    return {
        "detector": split["detector"],
        "seed": split["seed"],
        "runs": len(records),
        "failed_runs": len(errors),
        "scenarios": len(split["scenarios"]),
        **score_records(records),
    }


def render_scores(scores: dict, header: str | None = None) -> str:
    """Markdown: one table per axis (fault kind, layout), n and 95% Wilson intervals; `header`
    replaces the frozen detector's line (a re-judged design split)."""
    d = scores.get("detector")
    if header is None:
        header = (
            f"Detector: commit {d['commit'][:12]}, thresholds sha256 {d['thresholds_sha256'][:16]}; "
            f"{scores['runs']} of {scores['scenarios']} runs ({scores['failed_runs']} failed, not scored)."
        )
    lines = [header, ""]
    for axis in ("kind", "layout"):
        lines += [f"| {axis} | recall | top-1 | precision | false alarms (clean) |", "|---|---|---|---|---|"]
        for key, s in scores[axis].items():
            cells = [_cell(s[m]) for m in ("recall", "top1", "precision", "false_alarm")]
            lines.append(f"| {key} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def _cell(r: dict) -> str:
    if not r["n"]:
        return "-"
    lo, hi = r["ci95"]
    return f"{r['value']:.2f} ({r['k']}/{r['n']}, [{lo:.2f}, {hi:.2f}])"


def write_report(split_dir: Path) -> Path:
    from megatronapp.files import write_text_atomic

    scores = score_split(split_dir)
    write_text_atomic(Path(split_dir) / "scores.json", json.dumps(scores, indent=2) + "\n")
    out = Path(split_dir) / "scores.md"
    write_text_atomic(out, render_scores(scores) + "\n")
    return out
