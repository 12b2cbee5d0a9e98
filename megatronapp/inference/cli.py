"""`megatronapp generate`: text generation from a checkpoint on any TP x PP layout.

    megatronapp generate --load ckpt --prompt "Once upon" --max-new-tokens 32            # one process
    megatronapp generate --load ckpt --prompt a --prompt b --nproc-per-node 4 \\
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --json             # TP2 x PP2

Ranks are launched as for training (torch.distributed.run); rank 0 samples and writes the
result, which the launching process prints. Bad input fails in one line (exit 2) before
anything is launched.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from megatronapp.config import ConfigError
from megatronapp.files import write_text_atomic
from megatronapp.inference.generate import SamplingConfig
from megatronapp.launch.local import rank_argv, run_local_ranks, under_launcher


def add_generate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--load", required=True, help="checkpoint folder (any saved layout)")
    p.add_argument("--prompt", action="append", default=[], help="a prompt; repeat for a batch")
    p.add_argument("--prompt-file", default=None, help="one prompt per non-empty line")
    p.add_argument("--max-new-tokens", type=int, default=SamplingConfig.max_new_tokens)
    p.add_argument("--greedy", action="store_true", help="argmax decoding (the default unless --temperature etc.)")
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top-k", type=int, default=SamplingConfig.top_k)
    p.add_argument("--top-p", type=float, default=SamplingConfig.top_p)
    p.add_argument("--seed", type=int, default=SamplingConfig.seed)
    p.add_argument("--no-stop-on-eod", dest="stop_on_eod", action="store_false")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--cuda-graphs", action="store_true", help="replay decode steps as a CUDA graph (one GPU)")
    p.add_argument("--tokenizer-model", default=None, help="Hugging Face tokenizer.json; default: bytes")
    add_layout_arguments(p)


def add_layout_arguments(p: argparse.ArgumentParser) -> None:
    """Launch and layout flags shared by every inference-side command (generate, scope capture)."""
    p.add_argument("--nproc-per-node", type=int, default=None, help="launch N local processes")
    p.add_argument("--tensor-model-parallel-size", type=int, default=1)
    p.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    p.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda when present")
    p.add_argument("--bf16", action="store_true", help="bf16 weights and activations")
    p.add_argument("--result-file", default=None, help=argparse.SUPPRESS)


def build_sampling_config(args: argparse.Namespace) -> SamplingConfig:
    sampled = args.temperature is not None or args.top_k or args.top_p < 1
    if args.greedy and sampled:
        raise ConfigError("--greedy cannot be combined with --temperature / --top-k / --top-p")
    return SamplingConfig(max_new_tokens=args.max_new_tokens, greedy=not sampled,
                          temperature=args.temperature or SamplingConfig.temperature, top_k=args.top_k, top_p=args.top_p,
                          seed=args.seed, stop_on_eod=args.stop_on_eod)


def read_prompts(args: argparse.Namespace) -> list[str]:
    prompts = list(args.prompt)
    if args.prompt_file:
        if not os.path.isfile(args.prompt_file):
            raise ConfigError(f"--prompt-file {args.prompt_file} does not exist")
        prompts += [line for line in Path(args.prompt_file).read_text().splitlines() if line.strip()]
    if not prompts:
        raise ConfigError("give at least one --prompt or a --prompt-file")
    return prompts


def check_layout_args(args: argparse.Namespace):
    """Validate load folder and layout before launching; returns (model config, layout)."""
    from megatronapp.config import build_layout
    from megatronapp.inference.model import check_inference_layout, read_model_config
    from megatronapp.parallel.device import check_layout_devices
    from megatronapp.parallel.layout import LayoutError

    if not os.path.isfile(os.path.join(args.load, "latest")):
        raise ConfigError(f"--load {args.load}: no complete checkpoint there (missing 'latest')")
    for flag in ("nproc_per_node", "tensor_model_parallel_size", "pipeline_model_parallel_size"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise ConfigError(f"--{flag.replace('_', '-')} must be >= 1, got {value}")
    world = int(os.environ["WORLD_SIZE"]) if under_launcher() else (args.nproc_per_node or 1)
    cfg = read_model_config(args.load)
    layout = build_layout(world, args.tensor_model_parallel_size, args.pipeline_model_parallel_size)
    check_inference_layout(cfg, layout)
    if not under_launcher():  # the launcher checked the whole job's devices before starting it
        try:
            check_layout_devices(getattr(args, "device", None), layout)
        except LayoutError as exc:
            raise ConfigError(str(exc)) from None
    return cfg, layout


def check_generate_args(args: argparse.Namespace) -> None:
    from megatronapp.data.tokenizer import load_tokenizer
    from megatronapp.inference.generate import check_prompts

    cfg, _ = check_layout_args(args)
    sampling = build_sampling_config(args)
    tokenizer = load_tokenizer(args.tokenizer_model)
    if tokenizer.vocab_size > cfg.padded_vocab_size:
        raise ConfigError(f"tokenizer vocabulary {tokenizer.vocab_size} exceeds the model's {cfg.padded_vocab_size}")
    check_prompts([tokenizer.encode(p) for p in read_prompts(args)], sampling, cfg.seq_length, tokenizer.vocab_size)


def run_command(args: argparse.Namespace, argv: list[str], check, worker, render) -> int:
    """Validate, then run `worker(args) -> dict` here or on launched ranks; print render(result)."""
    try:
        check(args)
    except (ConfigError, ValueError, FileNotFoundError) as exc:
        print(f"megatronapp: error: {exc}", file=sys.stderr)
        return 2
    if under_launcher() or not args.nproc_per_node or args.nproc_per_node == 1:
        result = worker(args)
        if result is not None and args.result_file:
            write_text_atomic(args.result_file, json.dumps(result))
        elif result is not None:
            print(render(args, result))
        return 0
    result_file = Path(tempfile.mkdtemp(prefix="megatronapp-")) / "result.json"
    code = run_local_ranks("megatronapp.cli.main", rank_argv(argv, ["--result-file", str(result_file)]),
                           args.nproc_per_node)
    if code == 0:
        print(render(args, json.loads(result_file.read_text())))
    return code


def generate_worker(args: argparse.Namespace) -> dict | None:
    """Body of one rank: load, generate, return the result on rank 0 (None elsewhere)."""
    from megatronapp.data.tokenizer import load_tokenizer
    from megatronapp.inference.generate import generate
    from megatronapp.inference.launch import finish_worker, start_worker

    model = start_worker(args)
    model.cuda_graphs = args.cuda_graphs
    tokenizer = load_tokenizer(args.tokenizer_model)
    prompts = read_prompts(args)
    res = generate(model, [tokenizer.encode(p) for p in prompts], build_sampling_config(args),
                   eod_id=tokenizer.eod_id, vocab_size=tokenizer.vocab_size)
    out = {"layout": model.groups.layout.describe(), "prompts": prompts,
           "completions": [tokenizer.decode(t) for t in res.tokens], "tokens": res.tokens,
           "finished": res.finished, "prefill_s": res.prefill_s, "decode_s": res.decode_s,
           "decode_tokens_per_s": res.decode_tokens_per_s}
    finish_worker()
    return out if model.is_serving_rank else None


def render_generation(args: argparse.Namespace, result: dict) -> str:
    if args.json:
        return json.dumps(result)
    lines = []
    for prompt, completion in zip(result["prompts"], result["completions"]):
        lines += [f"--- {prompt!r}", prompt + completion]
    lines.append(f"[{result['layout']}] decode {result['decode_tokens_per_s']:.1f} tokens/s")
    return "\n".join(lines)


def add_generate_subcommand(sub) -> None:
    p = sub.add_parser("generate", help="generate text from a checkpoint (any TP x PP layout)")
    add_generate_arguments(p)
    p.set_defaults(run_with_argv=lambda args, argv: run_command(args, argv, check_generate_args, generate_worker,
                                                     render_generation))
