"""Python work on the model thread per decoded token, by where it lands relative to the device.

    python benchmarks/scope_ui_host_work.py [--new-tokens 32] [--flush-s 0.010] [--out F]   # CPU

On the GPU (CUDA-graph decode, batch 1) a decode step is: launch the step (graph replay), then
the host is free while the device computes (~2.7 ms for the 1.3B preset) until generate()'s
one sync per token (`bool(finished.all())`). Host work between that sync and the next launch
is *serial*: the device idles through it, so it adds to every token's wall time in full. Work
between the launch and the sync is *overlapped*: free as long as it is shorter than the step.
This counts, on the CPU, the Python-level calls (function calls and calls of builtins, via
sys.setprofile) the model thread makes per decode token in each window, for

    plain        generate() alone
    ui_captures  generate() under the UI's capture contexts (scope_ui.runner.stream_captures)
    ui_runner    GenerationRunner.run (the UI's model thread: captures, token tap, streaming
                 records to a sink; the server's encoding is on another thread, not counted)

plus the calls outside decode steps (setup, prefill, teardown) per generation. The windows are
marked by wrapping InferenceModel._run_decode (the launch) and the first Tensor.__bool__
after it (the sync); steps run on a static KV cache as under CUDA graphs, eagerly. The model's
own forward is not counted (on the GPU it is one graph replay). Calls are a proxy for host
time; the deterministic counts need no repeats. Wall-clock serial microseconds are printed
too (median over rounds, without the profiler), for orientation only on a loaded machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

import megatronapp.scope_ui.runner as runner_mod
from megatronapp.config import model_preset
from megatronapp.data.tokenizer import load_tokenizer
from megatronapp.inference.generate import SamplingConfig, generate
from megatronapp.inference.model import InferenceModel, build_inference_model
from megatronapp.parallel.groups import single_process_groups
from megatronapp.scope_ui import protocol as P
from megatronapp.files import write_text_atomic

PROMPT = "Once upon a time"
WINDOWS = ("outside", "serial", "serial_done", "step", "overlapped")


class HostWindows:
    """Which window the model thread is in; optionally counts profile events per window."""

    def __init__(self):
        self.window, self.calls = "outside", dict.fromkeys(WINDOWS, 0)
        self.serial_s, self._t = 0.0, None
        self.steps = 0

    def profile(self, frame, event, arg) -> None:
        if event in ("call", "c_call"):
            self.calls[self.window] += 1

    def launch(self) -> None:
        """A serial window counts only when a launch ends it (after the last step: teardown)."""
        if self.window == "serial":
            self.serial_s += time.perf_counter() - self._t
            self.calls["serial_done"] += self.calls["serial"]
        self.calls["serial"] = 0
        self.window, self.steps = "step", self.steps + 1

    def launched(self) -> None:
        self.window = "overlapped"

    def synced(self) -> None:
        if self.window == "overlapped":
            self.window, self._t = "serial", time.perf_counter()

    def done(self) -> None:
        self.calls["outside"] += self.calls["serial"]
        self.window, self._t, self.calls["serial"] = "outside", None, 0


def instrument(windows_ref: list):
    """Wrap the launch and the sync; returns an undo function."""
    run_decode, to_bool = InferenceModel._run_decode, torch.Tensor.__bool__

    def wrapped_decode(self, x):
        w = windows_ref[0]
        w.launch()
        try:
            return run_decode(self, x)
        finally:
            w.launched()

    def wrapped_bool(self):
        out = to_bool(self)
        windows_ref[0].synced()
        return out

    InferenceModel._run_decode, torch.Tensor.__bool__ = wrapped_decode, wrapped_bool

    def undo() -> None:
        InferenceModel._run_decode, torch.Tensor.__bool__ = run_decode, to_bool
    return undo


def variants(model, tok, new_tokens: int):
    prompt = tok.encode(PROMPT)
    sampling = SamplingConfig(max_new_tokens=new_tokens, stop_on_eod=False)
    runner = runner_mod.GenerationRunner(model, tok, P.Limits(max_capture_bytes=1 << 34))
    msg = P.Generate(type="generate", prompt=PROMPT, max_new_tokens=new_tokens, stop_on_eod=False)

    class Sink:
        def post(self, items):
            pass

    def plain():
        generate(model, [prompt], sampling, eod_id=tok.eod_id, vocab_size=tok.vocab_size)

    def ui_captures():
        caps = runner_mod.stream_captures(model, (0,), True, 1 << 34)
        with caps[0], caps[1]:
            generate(model, [prompt], sampling, eod_id=tok.eod_id, vocab_size=tok.vocab_size)

    def ui_runner():
        runner.run(msg, Sink(), [0])

    return {"plain": plain, "ui_captures": ui_captures, "ui_runner": ui_runner}


def measure(fn, profile: bool) -> HostWindows:
    w = HostWindows()
    ref = [w]
    undo = instrument(ref)
    if profile:
        sys.setprofile(w.profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
        undo()
        w.done()
    return w


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--flush-s", type=float, default=runner_mod.FLUSH_S, help="the runner's flush interval")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds (wall-clock serial us)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    runner_mod.FLUSH_S = args.flush_s
    cfg = model_preset(args.model, vocab_size=50304, seq_length=max(64, args.new_tokens + 16))
    model = build_inference_model(cfg, single_process_groups(), "cpu", seed=0)
    start = model.start
    model.start = lambda b, n, pad, static=None: start(b, n, pad, static=True)  # as under CUDA graphs
    tok = load_tokenizer(None)
    runs = variants(model, tok, args.new_tokens)
    for fn in runs.values():  # warm-up (memoised tables, first-call imports)
        measure(fn, profile=False)
    report = {"model": args.model, "new_tokens": args.new_tokens, "flush_s": args.flush_s}
    serial_us = {name: [] for name in runs}
    for _ in range(args.rounds):
        for name, fn in runs.items():
            w = measure(fn, profile=False)
            serial_us[name].append(1e6 * w.serial_s / max(w.steps - 1, 1))
    for name, fn in runs.items():
        w = measure(fn, profile=True)
        decode = max(w.steps, 1)
        report[name] = {"decode_steps": w.steps,
                        "serial_calls_per_token": round(w.calls["serial_done"] / max(decode - 1, 1), 1),
                        "overlapped_calls_per_token": round(w.calls["overlapped"] / decode, 1),
                        "calls_outside_decode_per_generation": w.calls["outside"],
                        "serial_us_per_token_median": round(statistics.median(serial_us[name]), 1),
                        "serial_us_range": [round(min(serial_us[name]), 1), round(max(serial_us[name]), 1)]}
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        write_text_atomic(args.out, text)


if __name__ == "__main__":
    main()
