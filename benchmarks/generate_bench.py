"""Generation benchmark: decode tokens/s of `megatronapp generate`'s engine vs Hugging Face
`transformers` generate on the exported model, MegaScope capture off/on, bytes per token.

    python benchmarks/generate_bench.py --model 1.3b --bf16 [--cuda-graphs] --out generate_bench.json   # GPU
    python benchmarks/generate_bench.py --model tiny --device cpu --prompt-len 8 --new-tokens 16   # CPU smoke

Without --load, a checkpoint of the preset (random init, vocab 50304) is written to a temp
folder. Variants are interleaved in rounds (ours_off, ours_capture, ours_scope_off,
[ours_eager, ours_eager_capture,] hf, ours_off, ...), after one warm-up generation each
(which captures the decode graphs); each figure is the median over rounds with min/max.
ours_scope_off is capture off with MegaScope used just before (a capture entered and left):
capture_off_overhead_pct compares it with ours_off (goal: within 0.5%; the same code runs,
so this is the noise floor); *_paired_pct are the same comparisons paired within each round
(median of per-round ratios, 95% bootstrap interval), which is what resolves 0.5%. Bytes per token count every captured step's items over the
step's new tokens (prefill included); the per-step op count is tests/support/op_count.py's. With --cuda-graphs,
ours_off / ours_capture replay the decode step as a CUDA graph (the capture recorded inside
it) and ours_eager* are the same without graphs. Decode tokens/s counts new tokens after the
first (prefill excluded), batch 1, no stop at end-of-text. "capture" is the default
compressed capture (scope.sites.DEFAULT_SITES, scope.compress.DEFAULT_COMPRESS).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch
from common import bootstrap_median_ci, sync

from megatronapp.config import build_layout, model_preset
from megatronapp.engine.checkpoint import save_checkpoint
from megatronapp.engine.trainer import Trainer
from megatronapp.files import write_text_atomic
from megatronapp.inference.generate import SamplingConfig, generate
from megatronapp.inference.model import build_inference_model, read_model_config
from megatronapp.job import build_job
from megatronapp.parallel.groups import single_process_groups
from megatronapp.scope.capture import capture
from megatronapp.scope.compress import DEFAULT_COMPRESS
from megatronapp.scope.sites import DEFAULT_SITES


class _NoData:
    def state_dict(self) -> dict:
        return {}


def write_preset_checkpoint(preset: str, device) -> str:
    job = build_job(model_preset(preset, vocab_size=50304), build_layout(1, 1, 1), train_iters=1)
    trainer = Trainer(job, single_process_groups(), device, _NoData())
    folder = tempfile.mkdtemp(prefix="gen-bench-")
    save_checkpoint(folder, trainer, _NoData())
    del trainer
    return folder


def time_ours(
    model, prompt, new_tokens: int, vocab: int, with_capture: bool, after_capture: bool = False
) -> tuple[float, dict]:
    """(decode tokens/s, {"bytes_per_token", "recorded_fraction"} of the capture, or {});
    after_capture: capture off, right after a capture was entered and left (nothing stays)."""
    sampling = SamplingConfig(max_new_tokens=new_tokens, stop_on_eod=False)
    if after_capture:
        with capture(model, DEFAULT_SITES, compress=DEFAULT_COMPRESS):
            pass
    if not with_capture:
        res = generate(model, [prompt], sampling, eod_id=0, vocab_size=vocab)
        return res.decode_tokens_per_s, {}
    with capture(model, DEFAULT_SITES, compress=DEFAULT_COMPRESS) as cap:
        res = generate(model, [prompt], sampling, eod_id=0, vocab_size=vocab)
    # recorded_fraction: decode steps whose capture ran inside the decode step (graph path)
    return res.decode_tokens_per_s, {
        "bytes_per_token": cap.bytes_per_token,
        "recorded_fraction": len(cap.recorded_steps) / max(res.decode_steps, 1),
    }


def load_hf(ckpt: str, device, dtype):
    """The exported transformers model, or None when interop/transformers are unavailable."""
    try:
        from transformers import AutoModelForCausalLM

        from megatronapp.interop.hf_checkpoint import export_hf
    except ImportError as e:
        print(f"skipping transformers comparison: {e}")
        return None
    out = tempfile.mkdtemp(prefix="gen-bench-hf-")
    export_hf(ckpt, out)
    return AutoModelForCausalLM.from_pretrained(out, torch_dtype=dtype).to(device).eval()


def time_hf(hf, prompt, new_tokens: int, device) -> float:
    ids = torch.tensor([prompt], device=device)
    kw = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.inference_mode():
        sync(device)
        t0 = time.perf_counter()
        hf.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw)  # prefill + first token
        sync(device)
        t1 = time.perf_counter()
        hf.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kw)
        sync(device)
        t2 = time.perf_counter()
    return (new_tokens - 1) / max((t2 - t1) - (t1 - t0), 1e-9)


def run_interleaved(variants: dict, rounds: int) -> dict[str, list[float]]:
    """Every variant once to warm up (kernels, allocator, decode graphs), then `rounds` rounds of
    all variants in turn; tokens/s per variant plus the capture figures of "ours_capture"."""
    results = {name: [] for name in variants}
    results.update(bytes_per_token=[], capture_recorded_fraction=[])
    for run in variants.values():
        run()
    for _ in range(rounds):
        for name, run in variants.items():
            tps, extra = run()
            results[name].append(tps)
            if name == "ours_capture":
                results["bytes_per_token"].append(extra["bytes_per_token"])
                results["capture_recorded_fraction"].append(extra["recorded_fraction"])
    return results


def paired_overhead_pct(off_tps: list[float], other_tps: list[float]) -> dict:
    """Per-token time of `other` over `off` in the same round, minus 1, in percent: the median
    over rounds and its 95% bootstrap interval (common.bootstrap_median_ci)."""
    med, lo, hi = bootstrap_median_ci([a / b for a, b in zip(off_tps, other_tps)])
    return {"median": 100.0 * (med - 1.0), "ci95": [100.0 * (lo - 1.0), 100.0 * (hi - 1.0)], "rounds": len(off_tps)}


def summarize(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--load", default=None)
    p.add_argument("--model", default="1.3b")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--no-hf", action="store_true")
    p.add_argument("--cuda-graphs", action="store_true", help="decode steps replayed as a CUDA graph (ours)")
    p.add_argument(
        "--no-eager",
        action="store_true",
        help="with --cuda-graphs, skip the eager-decode variants (many cheap rounds for the paired CIs)",
    )
    p.add_argument("--out", default=None)
    return p


def main() -> None:
    p = build_parser()
    args = p.parse_args()
    device, dtype = torch.device(args.device), torch.bfloat16 if args.bf16 else torch.float32
    ckpt = args.load or write_preset_checkpoint(args.model, device)
    cfg = read_model_config(ckpt)
    model = build_inference_model(cfg, single_process_groups(), device, load_dir=ckpt, dtype=dtype)
    hf = None if args.no_hf else load_hf(ckpt, device, dtype)
    prompt = torch.randint(0, cfg.vocab_size, (args.prompt_len,), generator=torch.Generator().manual_seed(0)).tolist()
    new = min(args.new_tokens, cfg.seq_length - args.prompt_len)
    if new < 2:
        p.error(f"--prompt-len {args.prompt_len} leaves {new} new tokens in the model's {cfg.seq_length} positions")

    def ours(graphs: bool, with_capture: bool, after_capture: bool = False):
        def run() -> tuple[float, dict]:
            model.cuda_graphs = graphs
            return time_ours(model, prompt, new, cfg.vocab_size, with_capture, after_capture)

        return run

    variants = {
        "ours_off": ours(args.cuda_graphs, False),
        "ours_capture": ours(args.cuda_graphs, True),
        "ours_scope_off": ours(args.cuda_graphs, False, after_capture=True),
    }
    eager_too = args.cuda_graphs and not args.no_eager
    if eager_too:  # the eager decode path side by side with the graph replay
        variants.update(ours_eager=ours(False, False), ours_eager_capture=ours(False, True))
    if hf is not None:
        variants["hf"] = lambda: (time_hf(hf, prompt, new, device), {})
    results = run_interleaved(variants, args.rounds)
    report = {
        "model": args.model if not args.load else args.load,
        "device": str(device),
        "dtype": str(dtype),
        "cuda_graphs": args.cuda_graphs,
        "prompt_len": args.prompt_len,
        "new_tokens": new,
        **{k: summarize(v) for k, v in results.items() if v},
    }
    off, on = report["ours_off"]["median"], report["ours_capture"]["median"]
    report["capture_overhead_pct"] = 100.0 * (off / on - 1.0)  # per token: time on / time off - 1
    report["capture_off_overhead_pct"] = 100.0 * (off / report["ours_scope_off"]["median"] - 1.0)
    for name in ("ours_capture", "ours_scope_off"):  # paired within rounds: drift cancels
        report[f"{name}_paired_pct"] = paired_overhead_pct(results["ours_off"], results[name])
    if eager_too:
        eager_off, eager_on = report["ours_eager"]["median"], report["ours_eager_capture"]["median"]
        report["eager_capture_overhead_pct"] = 100.0 * (eager_off / eager_on - 1.0)
    if hf is not None:
        report["speedup_vs_hf"] = off / report["hf"]["median"]
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        write_text_atomic(args.out, text)


if __name__ == "__main__":
    main()
