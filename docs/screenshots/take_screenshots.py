"""The README's MegaScope UI screenshots, taken from a trained checkpoint (the README's demo).

    python docs/screenshots/take_screenshots.py --load runs/demo-ckpt --out docs/screenshots

Trains nothing itself: it starts `megatronapp scope serve --load CKPT` (generation, attention,
a bit flip) and `megatronapp train --load CKPT --scope` (the training view, continuing from the
checkpoint), drives Debian's chromium headless through Playwright and writes generate.png,
attention.png, perturbed.png and training.png.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import threading
from contextlib import contextmanager
from pathlib import Path

CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
TIMEOUT_MS = 120_000
URL = re.compile(r"(http://127\.0\.0\.1:\d+/\S*)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--load", required=True, help="checkpoint folder (README demo: runs/demo-ckpt)")
    p.add_argument("--out", default="docs/screenshots", help="folder for the PNGs")
    p.add_argument("--chromium", default="/usr/bin/chromium")
    p.add_argument("--prompt", default="Once upon a time")
    p.add_argument("--new-tokens", type=int, default=24)
    p.add_argument(
        "--flip-bit",
        type=int,
        default=28,
        help="the fp32 bit flipped in layer 0's residual at position 2 (28: an exponent bit, a factor of 2**32 either way)",
    )
    p.add_argument("--train-model", default="demo", help="the checkpoint's --model preset, for the training view")
    return p


@contextmanager
def served(argv: list[str]):
    """Runs a megatronapp command that serves the UI; yields the URL it prints, stops it after."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "megatronapp.cli.main", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    found: list[str] = []
    ready = threading.Event()

    def read() -> None:  # keep draining, so the server never blocks on a full pipe
        for line in proc.stdout:
            match = URL.search(line)
            if match and not found:
                found.append(match.group(1))
                ready.set()
        ready.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        if not ready.wait(TIMEOUT_MS / 1000) or not found:
            raise SystemExit(f"`megatronapp {' '.join(argv)}` printed no URL (exit code {proc.poll()})")
        yield found[0]
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def _generate(page, prompt: str, n: int, run: str = "clean") -> None:
    page.fill("#prompt", prompt)
    page.fill("#max-new-tokens", str(n))
    page.click("#generate")
    page.wait_for_function(f"window.__scope.state.runs.{run} && window.__scope.state.runs.{run}.done")


def shoot_generation(browser, url: str, out: Path, prompt: str, n: int, flip_bit: int) -> None:
    page = browser.new_page(viewport={"width": 1280, "height": 1000})
    page.set_default_timeout(TIMEOUT_MS)
    page.goto(url)
    page.wait_for_selector("#perturb-panel select")
    _generate(page, prompt, n)
    page.wait_for_timeout(500)
    page.screenshot(path=str(out / "generate.png"), full_page=True)
    page.select_option("#layer", "1")
    page.locator("#head-grid canvas").nth(1).click()
    page.wait_for_timeout(1000)
    page.screenshot(path=str(out / "attention.png"), full_page=True)
    page.select_option("#layer", "0")
    page.fill("#p-layers", "0")
    page.fill("#p-positions", "2")
    page.fill("#p-bits", str(flip_bit))
    page.fill("#p-seed", "7")
    page.click("#p-add")
    page.wait_for_selector(".active-perturbation")
    _generate(page, prompt, n, run="perturbed")
    page.wait_for_selector("#divergence")
    page.wait_for_timeout(500)
    page.screenshot(path=str(out / "perturbed.png"), full_page=True)
    page.close()


def shoot_training(browser, url: str, out: Path) -> None:
    page = browser.new_page(viewport={"width": 1280, "height": 1000})
    page.set_default_timeout(TIMEOUT_MS)
    page.goto(url)
    page.wait_for_function("Number(document.getElementById('loss-curve').dataset.points || 0) >= 30")
    page.wait_for_selector("#probe b")
    page.click("#pause")
    page.wait_for_selector('#train-state[data-waiting="true"]')
    page.wait_for_timeout(1000)
    page.screenshot(path=str(out / "training.png"), full_page=True)
    page.close()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not Path(args.load).is_dir():
        raise SystemExit(f"--load {args.load}: no such checkpoint folder (run the README's first command)")
    if not Path(args.chromium).exists():
        raise SystemExit(f"--chromium {args.chromium}: not found (apt-get install chromium)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=args.chromium, args=CHROMIUM_ARGS)
        with served(["scope", "serve", "--load", args.load, "--port", "0", "--device", "cpu"]) as url:
            shoot_generation(browser, url, out, args.prompt, args.new_tokens, args.flip_bit)
        with served(
            [
                "train",
                "--model",
                args.train_model,
                "--load",
                args.load,
                "--train-iters",
                "100000",
                "--device",
                "cpu",
                "--log-interval",
                "1",
                "--scope",
                "--scope-port",
                "0",
                "--scope-every",
                "10",
            ]
        ) as url:
            shoot_training(browser, url, out)
        browser.close()
    print(f"wrote {', '.join(n + '.png' for n in ('generate', 'attention', 'perturbed', 'training'))} to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
