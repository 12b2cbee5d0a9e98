"""`megatronapp scope capture` and `megatronapp scope report`.

    megatronapp scope capture --load ckpt --prompt "Hello" --sites q,attn_probs,residual,topk \\
        --layers 0,3 --compress "reduce:op=absmax,width=64;quantize:dtype=fp16" --out run.safetensors \\
        [--perturb '{"kind": "gaussian", "sigma": 0.1, "target": {"site": "residual"}}'] \\
        [--nproc-per-node 4 --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2]
    megatronapp scope report run.safetensors --out report/

Sites, layers, heads, compression and perturbation specs are validated before any rank starts.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from megatronapp.config import ConfigError
from megatronapp.inference.cli import (add_layout_arguments, check_layout_args, read_prompts, run_command)
from megatronapp.inference.generate import SamplingConfig
from megatronapp.scope.compress import DEFAULT_COMPRESS
from megatronapp.scope.sites import DEFAULT_SITES


def _int_list(text: str | None):
    if text is None:
        return None
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"expected comma-separated integers, got {text!r}") from None


def _perturbation_specs(args) -> list:
    from megatronapp.scope.specs import Perturbation

    specs = []
    for text in args.perturb:
        if text.startswith("@"):
            if not Path(text[1:]).is_file():
                raise ConfigError(f"--perturb file {text[1:]} does not exist")
            text = Path(text[1:]).read_text()
        specs.append(Perturbation.from_json(text))
    return specs


def _capture_config(args, cfg):
    """Validated CaptureConfig for a model of `cfg`; perturbation specs are checked too."""
    from megatronapp.scope.capture import make_capture_config, validate_capture
    from megatronapp.scope.specs import validate_perturbation
    from megatronapp.scope.target import stand_in_target

    capture_cfg = make_capture_config([s for s in args.sites.split(",") if s], layers=_int_list(args.layers),
                                      heads=_int_list(args.heads), compress=args.compress or "", topk=args.topk,
                                      max_bytes_per_step=int(args.max_capture_mb * 2**20))
    validate_capture(cfg, capture_cfg)
    shapes = stand_in_target(cfg).full_param_shapes()
    for spec in _perturbation_specs(args):
        validate_perturbation(spec, cfg, shapes, torch.bfloat16 if args.bf16 else torch.float32)
    return capture_cfg


def check_capture_args(args) -> None:
    from megatronapp.data.tokenizer import load_tokenizer
    from megatronapp.inference.generate import check_prompts

    cfg, _ = check_layout_args(args)
    _capture_config(args, cfg)
    tokenizer = load_tokenizer(args.tokenizer_model)
    check_prompts([tokenizer.encode(p) for p in read_prompts(args)], SamplingConfig(max_new_tokens=args.max_new_tokens),
                  cfg.seq_length, tokenizer.vocab_size)
    if not args.out:
        raise ConfigError("--out FILE is required")


def capture_worker(args) -> dict | None:
    """One rank: load, install perturbations and capture, generate greedily, rank 0 saves."""
    from contextlib import ExitStack

    from megatronapp.data.tokenizer import load_tokenizer
    from megatronapp.inference.generate import generate
    from megatronapp.inference.launch import finish_worker, start_worker
    from megatronapp.scope.capture import Capture
    from megatronapp.scope.perturb import perturb
    from megatronapp.scope.store import save_capture

    model = start_worker(args)
    tokenizer = load_tokenizer(args.tokenizer_model)
    prompts = read_prompts(args)
    capture_cfg = _capture_config(args, model.cfg)
    with ExitStack() as stack:
        specs = _perturbation_specs(args)
        for spec in specs:
            stack.enter_context(perturb(model, spec))
        cap = stack.enter_context(Capture(model, capture_cfg))
        res = generate(model, [tokenizer.encode(p) for p in prompts], SamplingConfig(max_new_tokens=args.max_new_tokens),
                       eod_id=tokenizer.eod_id, vocab_size=tokenizer.vocab_size)
    out = None
    if model.is_serving_rank:
        completions = [tokenizer.decode(t) for t in res.tokens]
        save_capture(args.out, cap.manifest(), cap.items,
                     extra={"prompts": prompts, "completions": completions, "tokens": res.tokens,
                            "layout": model.groups.layout.describe(),
                            "perturbations": [json.loads(s.to_json()) for s in specs]})
        out = {"out": args.out, "items": len(cap.items), "bytes_per_token": cap.bytes_per_token,
               "completions": completions, "layout": model.groups.layout.describe()}
    finish_worker()
    return out


def render_capture(args, result: dict) -> str:
    if args.json:
        return json.dumps(result)
    return (f"captured {result['items']} items ({result['bytes_per_token']:.0f} bytes/token) "
            f"[{result['layout']}] -> {result['out']} (+ .json manifest)")


def _report(args) -> int:
    from megatronapp.scope.report import render_report

    try:
        written = render_report(args.file, args.out)
    except (ValueError, FileNotFoundError) as exc:
        print(f"megatronapp: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {len(written)} files to {args.out}")
    return 0


def add_scope_subcommands(sub) -> None:
    scope = sub.add_parser("scope", help="MegaScope: capture model internals, render reports")
    cmds = scope.add_subparsers(dest="scope_command", required=True)
    cap = cmds.add_parser("capture", help="generate while capturing sites; write safetensors + JSON manifest")
    cap.add_argument("--load", required=True)
    cap.add_argument("--prompt", action="append", default=[])
    cap.add_argument("--prompt-file", default=None)
    cap.add_argument("--max-new-tokens", type=int, default=SamplingConfig.max_new_tokens)
    cap.add_argument("--sites", default=",".join(DEFAULT_SITES), help="comma-separated; see megatronapp/scope/sites.py")
    cap.add_argument("--layers", default=None, help="comma-separated layer indices (default: all)")
    cap.add_argument("--heads", default=None, help="comma-separated heads kept for q/k/v/attn_probs")
    cap.add_argument("--compress", default=DEFAULT_COMPRESS,
                     help=f"compression ops (default {DEFAULT_COMPRESS!r}; '' keeps full tensors)")
    cap.add_argument("--topk", type=int, default=5)
    cap.add_argument("--max-capture-mb", type=float, default=1024.0, help="refuse steps whose raw capture is larger")
    cap.add_argument("--perturb", action="append", default=[], help="perturbation spec JSON, or @FILE")
    cap.add_argument("--out", default=None, help="capture file (safetensors)")
    cap.add_argument("--json", action="store_true")
    cap.add_argument("--tokenizer-model", default=None)
    add_layout_arguments(cap)
    cap.set_defaults(run_with_argv=lambda args, argv: run_command(args, argv, check_capture_args, capture_worker,
                                                        render_capture))
    rep = cmds.add_parser("report", help="render PNG heatmaps, attention maps and PCA of a capture file")
    rep.add_argument("file")
    rep.add_argument("--out", required=True, help="output folder")
    rep.set_defaults(func=_report)
    return cmds
