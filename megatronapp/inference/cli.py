"""`megatronapp generate`: text generation from a checkpoint on any TP x PP layout.

    megatronapp generate --load ckpt --prompt "Once upon" --max-new-tokens 32            # one process
    megatronapp generate --load ckpt --prompt a --prompt b --nproc-per-node 4 \\
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --json             # TP2 x PP2

Ranks are launched as for training (torch.distributed.run); rank 0 samples and writes the
result, which the launching process prints. Bad input fails in one line (exit 2) before
anything is launched (cli/validate.py).
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from pathlib import Path

from megatronapp.config import ConfigError, ModelConfig
from megatronapp.files import write_text_atomic
from megatronapp.flags import add_flags
from megatronapp.inference.generate import SamplingConfig
from megatronapp.launch.flags import DEVICE, LAYOUT_FLAGS, NPROC_PER_NODE, TOKENIZER_MODEL
from megatronapp.launch.local import RESULT_FILE, launched_world_size, run_ranks_for_result, under_launcher
from megatronapp.parallel.layout import ParallelLayout


def add_generate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--load", required=True, help="checkpoint folder (any saved layout)")
    p.add_argument("--prompt", action="append", default=[], help="a prompt; repeat for a batch")
    p.add_argument("--prompt-file", default=None, help="one prompt per non-empty line")
    p.add_argument("--max-new-tokens", type=int, default=SamplingConfig.max_new_tokens, help="tokens per prompt")
    p.add_argument("--greedy", action="store_true", help="argmax decoding (the default unless --temperature etc.)")
    p.add_argument(
        "--temperature",
        type=float,
        default=None,
        help=f"sample with this temperature (default: greedy; {SamplingConfig.temperature} when only --top-k/--top-p)",
    )
    p.add_argument("--top-k", type=int, default=SamplingConfig.top_k, help="sample from the k likeliest tokens; 0: all")
    p.add_argument("--top-p", type=float, default=SamplingConfig.top_p, help="nucleus sampling mass; 1: no filter")
    p.add_argument("--seed", type=int, default=SamplingConfig.seed, help="seed of the sampling generator")
    p.add_argument(
        "--no-stop-on-eod", dest="stop_on_eod", action="store_false", help="keep generating past an end-of-document"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--cuda-graphs", action="store_true", help="replay decode steps as a CUDA graph (one GPU)")
    add_layout_arguments(p)


def add_layout_arguments(p: argparse.ArgumentParser) -> None:
    """Launch, layout and tokenizer flags shared by every inference-side command (generate, scope
    capture|serve)."""
    add_flags(p, (NPROC_PER_NODE, *LAYOUT_FLAGS, DEVICE, TOKENIZER_MODEL), ParallelLayout)
    p.add_argument("--bf16", action="store_true", help="bf16 weights and activations")
    add_flags(p, (RESULT_FILE,), hidden=True)


def build_sampling_config(args: argparse.Namespace) -> SamplingConfig:
    sampled = args.temperature is not None or args.top_k or args.top_p < 1
    if args.greedy and sampled:
        raise ConfigError("--greedy cannot be combined with --temperature / --top-k / --top-p")
    return SamplingConfig(
        max_new_tokens=args.max_new_tokens,
        greedy=not sampled,
        temperature=args.temperature or SamplingConfig.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        stop_on_eod=args.stop_on_eod,
    )


def read_prompts(args: argparse.Namespace) -> list[str]:
    prompts = list(args.prompt)
    if args.prompt_file:
        if not os.path.isfile(args.prompt_file):
            raise ConfigError(f"--prompt-file {args.prompt_file} does not exist")
        prompts += [line for line in Path(args.prompt_file).read_text().splitlines() if line.strip()]
    if not prompts:
        raise ConfigError("give at least one --prompt or a --prompt-file")
    return prompts


@dataclass(frozen=True)
class InferenceRun:
    """What `generate`, `scope capture` or `scope serve` will launch on a checkpoint's model, and
    what the checks before launch read (cli/validate.py runs them)."""

    load: str  # the checkpoint folder
    model: ModelConfig  # its model
    nproc_per_node: int | None
    tp_size: int
    pp_size: int
    world_size: int
    vocab_size: int  # the tokenizer's
    device: str | None = None
    bf16: bool = False  # bf16 weights and activations
    visible_gpus: int | None = None  # None: under the launcher, which checked the whole job's devices
    prompts: tuple[tuple[int, ...], ...] = ()  # token ids; none for `scope serve`
    prompt_texts: tuple[str, ...] = ()  # the same prompts as given
    tokenizer_model: str | None = None  # None: bytes
    sampling: SamplingConfig | None = None
    cuda_graphs: bool = False  # generate: decode steps replayed as a CUDA graph
    as_json: bool = False  # print the result as one JSON object
    result_file: str | None = None  # a relaunched rank 0 writes its result here (launch.local)
    capture: object | None = None  # scope capture's request (scope/cli.py)
    port: int | None = None  # scope serve's
    host: str | None = None  # scope serve's bind address
    token: str | None = None  # scope serve's access token (None: generated for non-loopback binds)
    checkpoint_folder: str | None = None  # load's latest iter_ folder, whose files are verified before launch


def build_inference_run(
    args: argparse.Namespace, with_prompts: bool = True, load: str | None = None, **extra
) -> InferenceRun:
    """The run on the model of `load` (default: --load); a one-line ConfigError when the
    checkpoint or a prompt file is missing (what cannot be read cannot be checked)."""
    import torch

    from megatronapp.data.tokenizer import load_tokenizer
    from megatronapp.engine.checkpoint import find_latest
    from megatronapp.inference.model import read_model_config

    load = load or args.load
    if not os.path.isfile(os.path.join(load, "latest")):
        raise ConfigError(f"--load {load}: no complete checkpoint there (missing 'latest')")
    tokenizer = load_tokenizer(args.tokenizer_model)
    texts = tuple(read_prompts(args)) if with_prompts else ()
    world = launched_world_size(args.nproc_per_node)
    return InferenceRun(
        load=load,
        checkpoint_folder=str(find_latest(load)),
        model=read_model_config(load),
        nproc_per_node=args.nproc_per_node,
        tp_size=args.tensor_model_parallel_size,
        pp_size=args.pipeline_model_parallel_size,
        world_size=world,
        vocab_size=tokenizer.vocab_size,
        device=args.device,
        bf16=args.bf16,
        visible_gpus=None if under_launcher() else torch.cuda.device_count(),
        prompts=tuple(tuple(tokenizer.encode(p)) for p in texts),
        prompt_texts=texts,
        tokenizer_model=args.tokenizer_model,
        as_json=getattr(args, "json", False),
        result_file=args.result_file,
        **extra,
    )


def check_inference_layout_run(run: InferenceRun) -> None:
    """Layout sizes, the model on the layout as one replica, devices."""
    from megatronapp.config import build_layout
    from megatronapp.inference.model import check_inference_layout
    from megatronapp.parallel.device import check_layout_devices
    from megatronapp.parallel.layout import LayoutError

    for flag, value in (
        ("nproc-per-node", run.nproc_per_node),
        ("tensor-model-parallel-size", run.tp_size),
        ("pipeline-model-parallel-size", run.pp_size),
    ):
        if value is not None and value < 1:
            raise ConfigError(f"--{flag} must be >= 1, got {value}")
    layout = build_layout(run.world_size, run.tp_size, run.pp_size)
    check_inference_layout(run.model, layout)
    if run.visible_gpus is not None:
        try:
            check_layout_devices(run.device, layout, run.visible_gpus)
        except LayoutError as exc:
            raise ConfigError(str(exc)) from None


def check_inference_prompts(run: InferenceRun) -> None:
    """The tokenizer against the model, and the prompts with the tokens to generate."""
    from megatronapp.inference.generate import check_prompts

    if run.vocab_size > run.model.padded_vocab_size:
        raise ConfigError(f"tokenizer vocabulary {run.vocab_size} exceeds the model's {run.model.padded_vocab_size}")
    if run.sampling is not None:
        check_prompts([list(p) for p in run.prompts], run.sampling, run.model.seq_length, run.vocab_size)


def build_generate_run(args: argparse.Namespace) -> InferenceRun:
    return build_inference_run(args, sampling=build_sampling_config(args), cuda_graphs=args.cuda_graphs)


def run_command(run: InferenceRun, argv: list[str], worker, render) -> int:
    """Run `worker(run) -> dict` here or on launched ranks (the run was validated); print render(run, result)."""
    if under_launcher() or not run.nproc_per_node or run.nproc_per_node == 1:
        result = worker(run)
        if result is not None and run.result_file:
            write_text_atomic(run.result_file, json.dumps(result))
        elif result is not None:
            print(render(run, result))
        return 0
    code, result = run_ranks_for_result(argv, run.nproc_per_node)
    if code == 0:
        print(render(run, result))
    return code


def generate_prompts(model, run: InferenceRun, tokenizer):
    """Generate from the run's prompts with its sampling settings on this rank's `model`."""
    from megatronapp.inference.generate import generate

    prompts = [list(p) for p in run.prompts]
    return generate(model, prompts, run.sampling, eod_id=tokenizer.eod_id, vocab_size=tokenizer.vocab_size)


def generate_worker(run: InferenceRun) -> dict | None:
    """Body of one rank: load, generate, return the result on rank 0 (None elsewhere)."""
    from megatronapp.data.tokenizer import load_tokenizer
    from megatronapp.inference.launch import finish_worker, start_worker

    model = start_worker(run)
    model.cuda_graphs = run.cuda_graphs
    tokenizer = load_tokenizer(run.tokenizer_model)
    res = generate_prompts(model, run, tokenizer)
    out = {
        "layout": model.groups.layout.describe(),
        "prompts": list(run.prompt_texts),
        "completions": [tokenizer.decode(t) for t in res.tokens],
        "tokens": res.tokens,
        "finished": res.finished,
        "prefill_s": res.prefill_s,
        "decode_s": res.decode_s,
        "decode_tokens_per_s": res.decode_tokens_per_s,
    }
    finish_worker()
    return out if model.is_serving_rank else None


def render_generation(run: InferenceRun, result: dict) -> str:
    if run.as_json:
        return json.dumps(result)
    lines = []
    for prompt, completion in zip(result["prompts"], result["completions"]):
        lines += [f"--- {prompt!r}", prompt + completion]
    lines.append(f"[{result['layout']}] decode {result['decode_tokens_per_s']:.1f} tokens/s")
    return "\n".join(lines)


def add_generate_subcommand(sub) -> None:
    p = sub.add_parser("generate", help="generate text from a checkpoint (any TP x PP layout)")
    add_generate_arguments(p)
    p.set_defaults(
        build_run=build_generate_run,
        launch=lambda run, argv: run_command(run, argv, generate_worker, render_generation),
    )
