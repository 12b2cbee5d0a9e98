"""The README's MegaScan report screenshot: a fault-lab run with a real slow rank, its
`megatronapp trace report` page, photographed in Debian's chromium (headless, via Playwright).

    python docs/screenshots/take_report_screenshot.py --out docs/screenshots/report.png

Runs (as root: the lab writes a cgroup) a PP2 x DP2 engine job of 40 iterations with rank 2
under a cgroup CPU quota of a third of its fair share (nothing in the program knows), then
`megatronapp trace merge` and `trace report`, and screenshots the top of the page. With
--trace-dir it photographs the report of an existing run instead.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="docs/screenshots/report.png")
    p.add_argument("--trace-dir", default=None, help="photograph this run's report instead of running the lab")
    p.add_argument("--chromium", default="/usr/bin/chromium")
    p.add_argument("--height", type=int, default=1500, help="pixels of the page's top to keep")
    return p


def lab_run(work: Path) -> Path:
    from megatronapp.faultlab import EngineJob, LabPlan, SlowRank, run_lab

    job = EngineJob(
        tp=1,
        pp=2,
        dp=2,
        iters=40,
        extra=("--model", "tiny", "--hidden-size", "128", "--global-batch-size", "8", "--micro-batch-size", "2"),
    )
    result = run_lab(LabPlan(job, faults=(SlowRank(2, "quota", factor=3.0),), tag="shot"), work / "trace")
    if result.returncode != 0:
        raise SystemExit(f"the lab run failed (exit {result.returncode}); its log: {result.log}")
    print("lab:", "; ".join(result.applied))
    return result.trace_dir


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="report-shot-"))
    trace_dir = Path(args.trace_dir) if args.trace_dir else lab_run(work)
    html = work / "report.html"
    cli = [sys.executable, "-m", "megatronapp.cli.main", "trace"]
    subprocess.run([*cli, "merge", str(trace_dir), "-o", str(trace_dir / "timeline.json")], check=True)
    subprocess.run([*cli, "report", str(trace_dir), "--out", str(html)], check=True)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=args.chromium, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1100, "height": args.height})
        page.goto(html.as_uri())
        page.wait_for_load_state("load")
        page.screenshot(path=args.out, clip={"x": 0, "y": 0, "width": 1100, "height": args.height})
        browser.close()
    print(f"wrote {args.out} ({Path(args.out).stat().st_size // 1024} KiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
