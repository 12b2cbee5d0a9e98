"""The evaluation command line (benchmarks/scan_eval.py runs it): frozen splits of real lab faults
(`frozen`, frozen.py) and the older held-out evaluation of the in-process injectors, below.

Thresholds are chosen on design scenarios; the reported figures come from held-out scenarios
drawn from a different fixed seed (injected.SPLIT_SEEDS), scored with the thresholds the
design step wrote to a file (the held-out step refuses to run without one, or without an
explicit --default-thresholds; `tune` refuses anything but design results):

    # 1. design runs (default thresholds; every tuning-grid point recorded), then tuning
    python benchmarks/scan_eval.py run --split design --runs-per-kind 8 --clean-runs 12 --jobs 4 \
        --results out/scan_eval/design.jsonl
    python benchmarks/scan_eval.py tune out/scan_eval/design.jsonl --out out/scan_eval/thresholds.json
    # 2. held-out runs with those thresholds (>= 30 per fault kind, >= 50 clean), then the tables
    python benchmarks/scan_eval.py run --split heldout --runs-per-kind 30 --clean-runs 50 --jobs 4 \
        --thresholds out/scan_eval/thresholds.json --results out/scan_eval/heldout.jsonl --budget-s 480
    python benchmarks/scan_eval.py summarize out/scan_eval/heldout.jsonl   # heldout.md/.png/.json

Kinds: none, compute (constant slowdown 1.2-2x), intermittent (the same in 1 of every 2-4
iterations), link (2-50 ms late arrival on a pipeline link), two_faults (a slowdown and a link at
once), on random ranks/links. Sources: `megatronapp train` on TP/PP/DP layouts of <= 4 ranks and
the plain DDP example under `megatronapp trace run` (injected.SOURCES). Each run is a real
gloo job, one torch thread per rank, `--jobs` of them at once (one core per rank: 4 on 16
cores), each under `--timeout`. One JSON line per finished run is appended to `--results` at
once (single write + fsync), so a run stopped by `--budget-s` or killed outright keeps every
finished run; `--resume` skips the runs already there. Each line holds the scenario, the
verdict with the thresholds under test and with the defaults, timings, and (design) the verdict
at every grid point, so tuning and summaries need no traces. `--synthetic` swaps the jobs for
the trace simulator (a smoke test of the plumbing, not an evaluation).

Cost: a 4-rank run is ~23 s of CPU, mostly five Python processes importing torch (launcher +
ranks; training itself ~1.5 s), ~14 s wall on an idle 2-core VM; design runs add ~25
detections (~1-3 s). On 16 cores with --jobs 4, expect ~8-12 s per run, so ~2-3 s per run of
throughput: 170 held-out runs in ~6-8 min (hence --budget-s 480; --resume finishes a cut run).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict
from pathlib import Path

from megatronapp.faultlab.evaluation.injected import (
    COMPUTE_GRID,
    KINDS,
    LINK_GRID,
    SPLIT_SEEDS,
    compute_layout_scores,
    compute_scores,
    named_causes,
    plan_scenarios,
    scenario_from_dict,
    sources_without,
    tune_on_design,
)
from megatronapp.faultlab.evaluation.injected_runner import append_record, detect_run, execute_run, load_records
from megatronapp.faultlab.evaluation.report import plot_scores, render_markdown


class UsageError(ValueError):
    """Bad flags or files: one line on stderr, exit code 2."""


def save_json_atomic(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(payload, f, indent=2)
    os.replace(tmp, path)


def load_thresholds(path: str) -> dict:
    """The overrides of a thresholds file written by `tune` (on design runs only)."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise UsageError(f"--thresholds {path}: cannot read ({exc})") from None
    if doc.get("tuned_on_split") != "design" or not isinstance(doc.get("overrides"), dict):
        raise UsageError(f"--thresholds {path}: not a thresholds file written by `scan_eval.py tune`")
    return doc["overrides"]


def _prepare_results(path: Path, resume: bool, overrides: dict) -> set[str]:
    """Names already recorded (with --resume); refuses to mix thresholds or clobber results."""
    if not path.is_file() or path.stat().st_size == 0:
        return set()
    if not resume:
        raise UsageError(f"{path} already holds results: pass --resume to continue it, or another --results")
    text = path.read_bytes()
    if not text.endswith(b"\n"):  # a killed run's partial last line: cut it so appends stay valid
        with open(path, "r+b") as f:
            f.truncate(text.rfind(b"\n") + 1)
    records = load_records(path)
    if any(r.get("thresholds") != overrides for r in records):
        raise UsageError(f"{path} was run with other thresholds than now: use another --results")
    return {r["name"] for r in records}


def _tasks(args, overrides: dict, done: set[str]) -> list[dict]:
    plan = plan_scenarios(
        args.split, args.runs_per_kind, args.clean_runs, sources=sources_without(args.skip_layout), kinds=args.kinds
    )
    deadline = time.time() + args.budget_s if args.budget_s else None
    work = args.work_dir or tempfile.mkdtemp(prefix="scan-eval-")
    print(
        f"{len(plan)} scenarios in {args.split} (seed {SPLIT_SEEDS[args.split]}), {len(done)} done already, "
        f"running {len(plan) - len(done & {s.name for s in plan})} with {args.jobs} at once; work dir {work}",
        flush=True,
    )
    return [
        {
            "scenario": asdict(sc),
            "work_dir": work,
            "timeout_s": args.timeout,
            "deadline": deadline,
            "overrides": overrides,
            "thresholds_file": args.thresholds,
            "synthetic": args.synthetic,
            "keep_traces": args.keep_traces,
        }
        for sc in plan
        if sc.name not in done
    ]


def _verdict(r: dict) -> str:
    return r["error"] or ", ".join(f"{s['cause']}@{s['link'] or s['rank']}" for s in r["suspects"]) or "nobody"


def cmd_run(args) -> int:
    if args.split != "design" and not (args.thresholds or args.default_thresholds):
        raise UsageError(
            f"--split {args.split} needs --thresholds FILE (from `tune`) or, explicitly, --default-thresholds"
        )
    if args.split == "design" and args.thresholds:
        raise UsageError("design runs use the default thresholds (tuning happens after them): drop --thresholds")
    overrides = load_thresholds(args.thresholds) if args.thresholds else {}
    results = Path(args.results)
    results.parent.mkdir(parents=True, exist_ok=True)
    tasks = _tasks(args, overrides, _prepare_results(results, args.resume, overrides))
    t0, recorded, cut = time.perf_counter(), [], 0
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        futures = [pool.submit(execute_run, t) for t in tasks]
        for fut in as_completed(futures):
            r = fut.result()
            if r["error"] == "deadline":
                cut += 1
                continue
            append_record(results, r)
            recorded.append(r)
            sc = scenario_from_dict(r["scenario"])
            print(
                f"[{len(recorded)}/{len(tasks)} {time.perf_counter() - t0:6.0f}s] {sc.name:26s} {sc.layout:20s} "
                f"{sc.fault} -> {_verdict(r)} ({r['seconds']}s)",
                flush=True,
            )
    wall = time.perf_counter() - t0
    per_run = sorted(r["seconds"] for r in recorded)
    median = per_run[len(per_run) // 2] if per_run else 0.0
    print(
        f"recorded {len(recorded)} runs ({sum(bool(r['error']) for r in recorded)} failed) in {wall:.0f} s "
        f"({wall / max(len(recorded), 1):.1f} s per run with {args.jobs} at once; median run {median:.1f} s); "
        f"{cut} not started or cut by --budget-s (--resume continues) -> {results}"
    )
    return 0


def cmd_tune(args) -> int:
    records = [r for r in load_records(Path(args.results)) if not r["error"]]
    if any(r["split"] != "design" for r in records):
        raise UsageError(f"{args.results}: thresholds may only be tuned on design runs")
    if any("grid_compute" not in r for r in records):
        raise UsageError(f"{args.results}: records lack the tuning grid (written by an older harness?)")
    runs = [(scenario_from_dict(r["scenario"]), r["grid_compute"], r["grid_link"]) for r in records]
    if not runs:
        raise UsageError(f"{args.results}: no successful design runs to tune on")
    best, scores = tune_on_design(runs)
    save_json_atomic(
        Path(args.out),
        {
            "tuned_on_split": "design",
            "design_seed": SPLIT_SEEDS["design"],
            "design_results": str(args.results),
            "design_runs": len(runs),
            "overrides": best,
            "grid": {"compute": COMPUTE_GRID, "link": LINK_GRID},
            "design_scores": scores,
        },
    )
    print(f"tuned on {len(runs)} design runs: {best} -> {args.out}")
    return 0


def _summary_header(path: Path, ok: list[dict], failed: list[dict], default_thresholds: bool) -> dict:
    """Provenance lines of a summary: split and seed, thresholds and their file, run counts."""
    errors = "; ".join(sorted({f["error"][:80] for f in failed})[:3])
    return {
        "file": path.name,
        "split": f"{ok[0]['split']} (seed {SPLIT_SEEDS.get(ok[0]['split'])})",
        "thresholds": "defaults" if default_thresholds else (ok[0]["thresholds"] or "defaults"),
        "thresholds file": ok[0].get("thresholds_file") or "-",
        "runs scored": len(ok),
        "runs failed (not scored)": f"{len(failed)}: {errors}" if failed else "0",
        "median seconds per run": sorted(r["seconds"] for r in ok)[len(ok) // 2],
    }


def _write_text_atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def cmd_rejudge(args) -> int:
    """Judge the kept traces of a results file again with the detector as it is now (defaults),
    next to the verdict recorded when they ran: before/after counts while changing the detector.
    With --out, also a results file of the new verdicts (the record's thresholds and the defaults),
    which `summarize` scores like any other."""
    records = [r for r in load_records(Path(args.results)) if not r["error"]]
    rows, counts, rejudged = [], {}, []
    for r in records:
        trace = Path(args.work_dir) / r["name"] / "trace"
        if not trace.is_dir():
            continue
        sc = scenario_from_dict(r["scenario"])
        verdicts = detect_run(trace, r.get("thresholds") or {}, grid=False)
        rejudged.append(
            {**r, "suspects": verdicts["suspects"], "default_suspects": verdicts["default_suspects"], "rejudged": True}
        )
        now = named_causes(verdicts["default_suspects"])
        then = named_causes(r["default_suspects"])
        key = f"{sc.kind} {sc.source}"
        c = counts.setdefault(key, [0, 0, 0])
        c[0], c[1], c[2] = c[0] + 1, c[1] + (then == sc.truth()), c[2] + (now == sc.truth())
        rows.append(
            f"{sc.name:28s} {sc.layout:20s} {sc.fault.factor}x/{sc.fault.every} truth {sorted(sc.truth())} "
            f"recorded {sorted(then)} now {sorted(now)}"
        )
    if not rows:
        raise UsageError(f"no kept trace of {args.results} under {args.work_dir} (run with --keep-traces)")
    print("\n".join(rows))
    for key, (n, then, now) in sorted(counts.items()):
        print(f"{key:24s} {n:3d} runs: exact verdicts recorded {then}, now {now}")
    if args.out:
        _write_text_atomic(Path(args.out), "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in rejudged))
        print(f"{len(rejudged)} re-judged runs -> {args.out}")
    return 0


def cmd_summarize(args) -> int:
    path = Path(args.results)
    records = load_records(path)
    ok, failed = [r for r in records if not r["error"]], [r for r in records if r["error"]]
    if not ok:
        raise UsageError(f"{path}: no successful runs to summarize")
    if len({r["split"] for r in ok}) > 1 or len({json.dumps(r["thresholds"], sort_keys=True) for r in ok}) > 1:
        raise UsageError(f"{path}: mixes splits or thresholds: one evaluation per file")
    key = "default_suspects" if args.default_thresholds else "suspects"
    results = [(scenario_from_dict(r["scenario"]), r[key]) for r in ok]
    scores, layouts = compute_scores(results), compute_layout_scores(results)
    header = _summary_header(path, ok, failed, args.default_thresholds)
    md = Path(args.md) if args.md else path.with_suffix(".md")
    png = Path(args.png) if args.png else path.with_suffix(".png")
    text = render_markdown(scores, layouts, header)
    _write_text_atomic(md, text)
    plot_scores(scores, f"MegaScan detection, {header['split']}, {len(ok)} runs", png)
    save_json_atomic(md.with_suffix(".json"), {"header": header, "scores": scores, "layouts": layouts})
    print(text, end="")
    print(f"-> {md}, {png}, {md.with_suffix('.json')}")
    return 0


def _kind_count(text: str) -> tuple[str, int]:
    kind, _, count = text.partition("=")
    if not count.isdigit():
        raise argparse.ArgumentTypeError(f"expected KIND=N (e.g. two_faults=10), got {text!r}")
    return kind.strip(), int(count)


def _kinds(text: str) -> tuple[str, ...]:
    kinds = tuple(k.strip() for k in text.split(",") if k.strip())
    if not kinds or set(kinds) - set(KINDS):
        raise argparse.ArgumentTypeError(f"expected a comma-separated subset of {','.join(KINDS)}, got {text!r}")
    return kinds


def cmd_frozen(args) -> int:
    """Frozen evaluation on real faults from the fault lab (frozen.py)."""
    import megatronapp.faultlab.evaluation.frozen as frozen
    import megatronapp.faultlab.evaluation.frozen_run as frozen_run

    if args.action == "thresholds":
        frozen.write_default_thresholds(Path(args.out))
        print(f"wrote {args.out}: every detector threshold at its default")
    elif args.action == "freeze":
        split = frozen.freeze_split(
            Path(args.split), Path(args.thresholds), args.runs_per_kind, args.clean_runs, kind_runs=dict(args.kind_runs)
        )
        print(
            f"froze {args.split}: {len(split['scenarios'])} scenarios, detector {split['detector']['commit'][:12]} "
            f"thresholds {split['detector']['thresholds_sha256'][:16]}"
        )
    elif args.action == "run":
        # a SIGTERM must unwind through the lab's finally blocks (cgroups, namespaces, busy loops)
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
        work_dir = Path(args.work_dir or tempfile.mkdtemp())
        results = frozen_run.run_split(
            Path(args.split), work_dir, resume=args.resume, budget_s=args.budget_s, keep_traces=args.keep_traces
        )
        print(f"results: {results}")
    elif args.action == "rejudge":
        _rejudge_frozen(Path(args.split), Path(args.work_dir), Path(args.out))
    else:
        print(frozen_run.write_report(Path(args.split)).read_text(), end="")
    return 0


def _rejudge_frozen(split: Path, work_dir: Path, out: Path) -> None:
    """A design split's kept traces judged by today's detector: OUT/results.jsonl and OUT/scores.md."""
    import megatronapp.faultlab.evaluation.frozen_run as frozen_run
    from megatronapp.faultlab.evaluation.frozen import code_version

    records = frozen_run.rejudge_split(split, work_dir)
    out.mkdir(parents=True, exist_ok=True)
    _write_text_atomic(out / "results.jsonl", "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in records))
    ok = [r for r in records if not r["error"]]
    code = code_version()
    header = (
        f"Design split {split.name} re-judged from its kept traces by the detector at commit {code['commit'][:12]}"
        f"{' with uncommitted changes' if code['dirty'] else ''} (defaults); {len(ok)} runs."
    )
    _write_text_atomic(out / "scores.md", frozen_run.render_scores(frozen_run.score_records(records), header) + "\n")
    print((out / "scores.md").read_text(), end="")


def _add_frozen_parser(sub) -> None:
    fz = sub.add_parser("frozen", help="frozen splits of real lab faults: thresholds, freeze, run (once), score")
    fz.add_argument("action", choices=("thresholds", "freeze", "run", "score", "rejudge"))
    fz.add_argument("split", nargs="?", help="the split's directory (freeze, run, score, rejudge)")
    fz.add_argument("--out", help="thresholds: the file to write; rejudge: the directory of the new verdicts")
    fz.add_argument("--thresholds", help="freeze: the thresholds file of the detector under test")
    fz.add_argument("--runs-per-kind", type=int, default=30)
    fz.add_argument("--clean-runs", type=int, default=50, help="half of them under background noise")
    fz.add_argument(
        "--kind-runs",
        type=_kind_count,
        action="append",
        default=[],
        metavar="KIND=N",
        help="freeze: N runs of this fault kind instead of --runs-per-kind (repeatable)",
    )
    fz.add_argument("--work-dir", help="run: where traces go while detected; rejudge: where they were kept")
    fz.add_argument("--resume", action="store_true", help="run: the scenarios a cut run has not recorded")
    fz.add_argument("--budget-s", type=float, default=0.0, help="run: start no run after this many seconds")
    fz.add_argument("--keep-traces", action="store_true", help="run: keep every run's trace (design splits)")
    fz.set_defaults(func=cmd_frozen)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="execute a split's scenarios, one JSON line per run (resumable)")
    run.add_argument("--split", choices=tuple(SPLIT_SEEDS), required=True)
    run.add_argument("--runs-per-kind", type=int, default=30, help="runs of each fault kind")
    run.add_argument(
        "--skip-layout",
        action="append",
        default=[],
        metavar="LAYOUT",
        help="leave this layout out of the plan, e.g. 'ddp dp4' on a host with fewer cores than its ranks",
    )
    run.add_argument(
        "--kinds",
        type=_kinds,
        default=KINDS,
        help=f"comma-separated subset of {','.join(KINDS)} (default all; scenarios are the same)",
    )
    run.add_argument("--clean-runs", type=int, default=50)
    run.add_argument("--results", required=True, help="JSONL file the runs are appended to")
    run.add_argument("--resume", action="store_true", help="continue --results, skipping the runs it holds")
    run.add_argument("--thresholds", help="held-out splits: the file `tune` wrote")
    run.add_argument(
        "--default-thresholds", action="store_true", help="a held-out split without tuning (say so when quoting)"
    )
    run.add_argument(
        "--jobs",
        type=int,
        default=max(1, len(os.sched_getaffinity(0)) // 4),
        help="runs at once (<= 4 ranks each; default: cores / 4)",
    )
    run.add_argument(
        "--timeout", type=float, default=120.0, help="hard limit per run, seconds (the whole process tree is killed)"
    )
    run.add_argument("--budget-s", type=float, default=0.0, help="stop starting/finish runs after this many seconds")
    run.add_argument("--work-dir", help="where traces go while a run is detected (default: a temp dir)")
    run.add_argument(
        "--keep-traces",
        action="store_true",
        help="keep every run's trace in --work-dir (default: failed runs' and wrong verdicts' only)",
    )
    run.add_argument("--synthetic", action="store_true", help="simulate the jobs (plumbing smoke, not an evaluation)")
    tune = sub.add_parser("tune", help="choose thresholds on design results")
    tune.add_argument("results", help="design JSONL")
    tune.add_argument("--out", required=True, help="thresholds file to write (read by run --thresholds)")
    summ = sub.add_parser("summarize", help="metrics with 95%% Wilson intervals: markdown, PNG and JSON")
    summ.add_argument("results", help="JSONL of one split")
    summ.add_argument("--md", help="default: RESULTS with .md")
    summ.add_argument("--png", help="default: RESULTS with .png")
    summ.add_argument("--default-thresholds", action="store_true", help="score the default-threshold verdicts instead")
    rejudge = sub.add_parser("rejudge", help="detect again on kept traces (defaults): recorded vs current verdicts")
    rejudge.add_argument("results", help="JSONL of runs made with --keep-traces")
    rejudge.add_argument("--work-dir", required=True, help="the --work-dir those runs kept their traces in")
    rejudge.add_argument("--out", help="write the runs with today's verdicts here (JSONL, for summarize)")
    rejudge.set_defaults(func=cmd_rejudge)
    _add_frozen_parser(sub)
    run.set_defaults(func=cmd_run)
    tune.set_defaults(func=cmd_tune)
    summ.set_defaults(func=cmd_summarize)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "run" and (
            args.runs_per_kind < 0 or args.clean_runs < 0 or args.jobs < 1 or args.timeout <= 0 or args.budget_s < 0
        ):
            raise UsageError("--runs-per-kind/--clean-runs/--budget-s must be >= 0, --jobs >= 1, --timeout > 0")
        if args.command == "frozen" and (
            (args.action == "thresholds") != (args.split is None)
            or (args.action == "thresholds" and not args.out)
            or (args.action == "freeze" and not args.thresholds)
        ):
            raise UsageError("frozen thresholds --out FILE | freeze SPLIT --thresholds FILE | run SPLIT | score SPLIT")
        return args.func(args)
    except (UsageError, ValueError, OSError) as exc:
        print(f"scan_eval: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
