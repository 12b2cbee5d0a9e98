"""`trace report` in a real browser (Playwright driving Debian's chromium, headless, offline): the
page of a run with a slow rank renders its charts with legends and axes, names the rank in the
verdict with its evidence, and logs no script error. Traces from tests/scan_simulation.py."""

from __future__ import annotations

import pytest
from scan_simulation import SimulatedJob
from scope_ui_jobs import CHROMIUM_ARGS, chromium_or_skip
from test_scan_report import JOB, _cli, _write


@pytest.fixture(scope="module")
def page():
    path = chromium_or_skip()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=path, args=CHROMIUM_ARGS)
        yield browser.new_page(viewport={"width": 1200, "height": 900})
        browser.close()


def _open(page, tmp_path, **fault) -> list[str]:
    _write(tmp_path / "t", SimulatedJob(**JOB, **fault))
    out = tmp_path / "report.html"
    assert _cli(["report", str(tmp_path / "t"), "--out", str(out)]) == 0
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.goto(out.as_uri())
    page.wait_for_load_state("load")
    return errors


def test_a_slow_ranks_report_renders_its_verdict_charts_and_legends(page, tmp_path):
    errors = _open(page, tmp_path, slow_rank=3, slow_factor=1.8)
    body = page.inner_text("body")
    assert "rank 3" in body and "slow_compute" in body, body[:600]
    charts = page.query_selector_all("svg")
    assert len(charts) >= 2
    for svg in charts[:2]:
        box = svg.bounding_box()
        assert box and box["width"] > 200 and box["height"] > 100  # drawn, not collapsed
    svg_text = " ".join(svg.text_content() for svg in charts)
    assert "ms" in svg_text and "iteration" in svg_text.lower()  # axes carry units
    assert errors == []


def test_a_clean_runs_report_says_so_in_the_browser(page, tmp_path):
    errors = _open(page, tmp_path)
    assert "nothing" in page.inner_text("body").lower() and errors == []
