"""MegaScope UI in a real browser (Playwright driving Debian's chromium, headless, offline).

One generation server, one training server and one browser for the whole module. Screenshots
of each view go to $MEGATRONAPP_SCREENSHOT_DIR (default: a pytest temp folder); the README's
come from the demo's trained model (`docs/screenshots/take_screenshots.py`).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from scope_ui_jobs import CHROMIUM_ARGS, TrainingServer, chromium_or_skip, save_ui_checkpoint, start_generation_server

TIMEOUT_MS = 60_000


@pytest.fixture(scope="module")
def shots(tmp_path_factory) -> Path:
    out = Path(os.environ.get("MEGATRONAPP_SCREENSHOT_DIR") or tmp_path_factory.mktemp("screenshots"))
    out.mkdir(parents=True, exist_ok=True)
    return out


@pytest.fixture(scope="module")
def browser():
    path = chromium_or_skip()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=path, args=CHROMIUM_ARGS)
        yield b
        b.close()


@pytest.fixture(scope="module")
def gen_page(browser, tmp_path_factory):
    torch.set_num_threads(1)
    ckpt = str(tmp_path_factory.mktemp("ui_ckpt"))
    save_ui_checkpoint(ckpt)
    srv = start_generation_server(ckpt)
    page = browser.new_page(viewport={"width": 1280, "height": 1000})
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.set_default_timeout(TIMEOUT_MS)
    page.goto(srv.url)
    page.wait_for_selector("#perturb-panel select")
    yield page
    page.close()
    srv.stop()
    assert not errors, errors


def _generate(page, prompt: str, n: int) -> None:
    page.fill("#prompt", prompt)
    page.fill("#max-new-tokens", str(n))
    page.click("#generate")


def test_generate_streams_tokens_with_topk(gen_page, shots):
    page = gen_page
    _generate(page, "Once upon a time", 10)
    page.wait_for_function("window.__scope.state.runs.clean && window.__scope.state.runs.clean.done")
    tokens = page.locator('.run[data-run="clean"] .tok.gen')
    assert tokens.count() >= 1
    tokens.nth(0).hover()
    rows = page.locator("#topk table tr")
    assert rows.count() == 5
    first = float(rows.nth(0).locator("td").nth(1).inner_text())
    assert 0 < first <= 1
    assert page.locator("#lens table tr").count() == 1 + 4  # header + one row per layer
    assert page.locator("#pca circle").count() >= 2
    page.screenshot(path=str(shots / "generate.png"), full_page=True)


def test_switching_layer_and_head_changes_attention(gen_page, shots):
    page = gen_page
    checksum = lambda: page.get_attribute("#attn-matrix", "data-checksum")
    pixels = lambda: page.evaluate("document.getElementById('attn-matrix').toDataURL()")
    page.select_option("#layer", "0")
    page.select_option("#head", "0")
    before, before_px = checksum(), pixels()
    page.select_option("#head", "2")
    after_head = checksum()
    assert after_head != before and pixels() != before_px
    rows = page.get_attribute("#attn-matrix", "data-rows")
    assert int(rows) >= 2
    page.select_option("#layer", "3")  # not captured by the run: the server refills it
    page.wait_for_function(f"document.getElementById('attn-matrix').dataset.rows === '{rows}'")
    assert checksum() != after_head
    page.locator("#head-grid canvas").nth(1).click()  # the grid picks a head too
    assert page.input_value("#head") == "1"
    page.screenshot(path=str(shots / "attention.png"), full_page=True)


def test_bit_flip_marks_first_divergence(gen_page, shots):
    page = gen_page
    page.fill("#p-layers", "0")
    page.fill("#p-positions", "2")
    page.fill("#p-bits", "30")
    page.fill("#p-seed", "7")
    page.click("#p-add")
    page.wait_for_selector(".active-perturbation")
    assert "seed=7" in page.inner_text("#p-active")
    _generate(page, "Once upon a time", 6)
    page.wait_for_selector("#divergence")
    marker = page.locator('.run[data-run="perturbed"] .tok.diverge')
    assert marker.count() == 1
    assert page.inner_text("#divergence").startswith("first diverging token: step ")
    page.screenshot(path=str(shots / "perturbed.png"), full_page=True)
    page.click("#p-clear")
    page.wait_for_function("window.__scope.state.perturbations.length === 0")


def test_training_view_curve_grows_pause_resume(browser, shots):
    torch.set_num_threads(1)
    training = TrainingServer()
    page = browser.new_page(viewport={"width": 1280, "height": 1000})
    page.set_default_timeout(TIMEOUT_MS)
    points = lambda: int(page.get_attribute("#loss-curve", "data-points") or 0)
    try:
        page.goto(training.server.url)
        page.wait_for_function("Number(document.getElementById('loss-curve').dataset.points || 0) >= 3")
        page.wait_for_selector("#probe b")
        page.click("#pause")
        page.wait_for_selector('#train-state[data-waiting="true"]')  # the running step has reported
        held = points()
        page.wait_for_timeout(1500)
        assert points() == held
        page.click("#step")
        page.wait_for_function(f"Number(document.getElementById('loss-curve').dataset.points) === {held + 1}")
        page.wait_for_selector('#train-state[data-waiting="true"]')
        page.wait_for_timeout(1000)
        assert points() == held + 1
        page.screenshot(path=str(shots / "training.png"), full_page=True)
        page.click("#resume")
        page.wait_for_function(f"Number(document.getElementById('loss-curve').dataset.points) >= {held + 4}")
    finally:
        page.close()
        training.stop()


def test_training_view_draws_validation_loss_beside_the_loss(browser, shots):
    torch.set_num_threads(1)
    training = TrainingServer(eval_every=2)
    page = browser.new_page(viewport={"width": 1280, "height": 1000})
    page.set_default_timeout(TIMEOUT_MS)
    try:
        page.goto(training.server.url)
        page.wait_for_function("Number(document.getElementById('loss-curve').dataset.secondPoints || 0) >= 2")
        assert page.locator("#loss-curve path.second").count() == 1
        assert "validation:" in page.text_content("#loss-curve")
        page.screenshot(path=str(shots / "training_validation.png"), full_page=True)
    finally:
        page.close()
        training.stop()
