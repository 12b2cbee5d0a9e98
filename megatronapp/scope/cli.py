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
from dataclasses import dataclass
from pathlib import Path

import torch

from megatronapp.config import ConfigError
from megatronapp.inference.cli import add_layout_arguments, build_inference_run, generate_prompts, run_command
from megatronapp.inference.generate import SamplingConfig
from megatronapp.scope.capture import CaptureConfig
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


@dataclass(frozen=True)
class CaptureRequest:
    """What `scope capture` records: sites and compression, perturbations, the output file."""

    config: object  # scope.capture.CaptureConfig
    perturbations: tuple = ()  # scope.specs.Perturbation
    bf16: bool = False
    out: str | None = None


def build_capture_request(args) -> CaptureRequest:
    """Parsed from the flags (and --perturb @FILE); the checks against the model are check_capture."""
    from megatronapp.scope.capture import make_capture_config

    config = make_capture_config(
        [s for s in args.sites.split(",") if s],
        layers=_int_list(args.layers),
        heads=_int_list(args.heads),
        compress=args.compress or "",
        topk=args.topk,
        max_bytes_per_step=int(args.max_capture_mb * 2**20),
    )
    return CaptureRequest(config, tuple(_perturbation_specs(args)), args.bf16, args.out)


def check_capture(request: CaptureRequest, cfg) -> None:
    """Sites, layers, heads and every perturbation against a model of `cfg`; an output file."""
    from megatronapp.scope.capture import validate_capture
    from megatronapp.scope.specs import validate_perturbation
    from megatronapp.scope.target import stand_in_target

    validate_capture(cfg, request.config)
    shapes = stand_in_target(cfg).full_param_shapes()
    for spec in request.perturbations:
        validate_perturbation(spec, cfg, shapes, torch.bfloat16 if request.bf16 else torch.float32)
    if not request.out:
        raise ConfigError("--out FILE is required")


def build_capture_run(args):
    return build_inference_run(
        args, sampling=SamplingConfig(max_new_tokens=args.max_new_tokens), capture=build_capture_request(args)
    )


def capture_worker(run) -> dict | None:
    """One rank: load, install perturbations and capture, generate greedily, rank 0 saves."""
    from contextlib import ExitStack

    from megatronapp.data.tokenizer import load_tokenizer
    from megatronapp.inference.launch import finish_worker, start_worker
    from megatronapp.scope.capture import Capture
    from megatronapp.scope.perturb import perturb
    from megatronapp.scope.store import save_capture

    model = start_worker(run)
    tokenizer = load_tokenizer(run.tokenizer_model)
    prompts = list(run.prompt_texts)
    request = run.capture
    capture_cfg = request.config
    with ExitStack() as stack:
        specs = request.perturbations
        for spec in specs:
            stack.enter_context(perturb(model, spec))
        cap = stack.enter_context(Capture(model, capture_cfg))
        res = generate_prompts(model, run, tokenizer)
    out = None
    if model.is_serving_rank:
        completions = [tokenizer.decode(t) for t in res.tokens]
        save_capture(
            request.out,
            cap.manifest(),
            cap.items,
            extra={
                "prompts": prompts,
                "completions": completions,
                "tokens": res.tokens,
                "layout": model.groups.layout.describe(),
                "perturbations": [json.loads(s.to_json()) for s in specs],
            },
        )
        out = {
            "out": request.out,
            "items": len(cap.items),
            "bytes_per_token": cap.bytes_per_token,
            "completions": completions,
            "layout": model.groups.layout.describe(),
        }
    finish_worker()
    return out


def render_capture(run, result: dict) -> str:
    if run.as_json:
        return json.dumps(result)
    return (
        f"captured {result['items']} items ({result['bytes_per_token']:.0f} bytes/token) "
        f"[{result['layout']}] -> {result['out']} (+ .json manifest)"
    )


@dataclass(frozen=True)
class ScopeReportRun:
    file: str  # capture file written by scope capture
    out: str  # folder the pictures go to


def check_scope_report_run(run: ScopeReportRun) -> None:
    if not Path(run.file).is_file():
        raise FileNotFoundError(f"{run.file}: no such capture file")
    if Path(run.out).exists() and not Path(run.out).is_dir():
        raise ValueError(f"--out {run.out} is a file, not a folder")


def run_scope_report(run: ScopeReportRun, argv: list[str]) -> int:
    from megatronapp.scope.report import render_report

    try:
        written = render_report(run.file, run.out)
    except (ValueError, FileNotFoundError) as exc:
        print(f"megatronapp: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {len(written)} files to {run.out}")
    return 0


def add_scope_subcommands(sub) -> None:
    scope = sub.add_parser("scope", help="MegaScope: capture model internals, render reports")
    cmds = scope.add_subparsers(dest="scope_command", required=True)
    cap = cmds.add_parser("capture", help="generate while capturing sites; write safetensors + JSON manifest")
    cap.add_argument("--load", required=True, help="checkpoint folder (any saved layout)")
    cap.add_argument("--prompt", action="append", default=[], help="a prompt; repeat for a batch")
    cap.add_argument("--prompt-file", default=None, help="one prompt per non-empty line")
    cap.add_argument(
        "--max-new-tokens",
        type=int,
        default=SamplingConfig.max_new_tokens,
        help="tokens generated (greedily) per prompt",
    )
    cap.add_argument("--sites", default=",".join(DEFAULT_SITES), help="comma-separated; see megatronapp/scope/sites.py")
    cap.add_argument("--layers", default=None, help="comma-separated layer indices (default: all)")
    cap.add_argument("--heads", default=None, help="comma-separated heads kept for q/k/v/attn_probs")
    cap.add_argument(
        "--compress",
        default=DEFAULT_COMPRESS,
        help=f"compression ops (default {DEFAULT_COMPRESS!r}; '' keeps full tensors)",
    )
    cap.add_argument(
        "--topk", type=int, default=CaptureConfig.topk, help="entries kept by the topk and logit_lens sites"
    )
    cap.add_argument(
        "--max-capture-mb",
        type=float,
        default=CaptureConfig.max_bytes_per_step / 2**20,
        help="refuse steps whose raw capture is larger",
    )
    cap.add_argument("--perturb", action="append", default=[], help="perturbation spec JSON, or @FILE")
    cap.add_argument("--out", default=None, help="capture file (safetensors)")
    cap.add_argument("--json", action="store_true", help="print the manifest as one JSON object")
    add_layout_arguments(cap)
    cap.set_defaults(
        build_run=build_capture_run,
        launch=lambda run, argv: run_command(run, argv, capture_worker, render_capture),
    )
    rep = cmds.add_parser("report", help="render PNG heatmaps, attention maps and PCA of a capture file")
    rep.add_argument("file", help="capture file written by scope capture")
    rep.add_argument("--out", required=True, help="output folder")
    rep.set_defaults(build_run=lambda a: ScopeReportRun(a.file, a.out), launch=run_scope_report)
    return cmds
