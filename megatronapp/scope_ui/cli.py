"""`megatronapp scope serve` and the `train --scope` flags.

    megatronapp scope serve --load ckpt                    # http://127.0.0.1:8765/
    megatronapp scope serve --load ckpt --host 0.0.0.0     # prints a generated access token
    megatronapp scope serve                                # no checkpoint: uses ./ckpt, or trains a tiny one
    megatronapp train --model tiny --train-iters 500 --device cpu --log-interval 1 --scope [--scope-port P]

    megatronapp scope serve --load ckpt --nproc-per-node 4 --tensor-model-parallel-size 2 \
        --pipeline-model-parallel-size 2                   # the model over 4 ranks, UI on rank 0

`serve` runs the model on any TP x PP layout, launched as for `generate`: rank 0 hosts the
web server and every rank runs each generation (scope_ui/ranks.py). `train --scope` serves
the training view from a one-process run.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from megatronapp.config import ConfigError
from megatronapp.inference.cli import add_layout_arguments, build_inference_run
from megatronapp.launch.local import rank_argv, run_local_ranks, under_launcher

DEMO_CHECKPOINTS = ("ckpt",)  # where the README's training example saves
TINY_DEMO_DIR = Path.home() / ".cache" / "megatronapp" / "scope-demo"
TINY_DEMO_TRAIN = [
    "--model",
    "tiny",
    "--train-iters",
    "80",
    "--global-batch-size",
    "4",
    "--micro-batch-size",
    "4",
    "--device",
    "cpu",
    "--log-interval",
    "20",
]


@dataclass(frozen=True)
class TrainingScopeConfig:
    """`train --scope`: where the training view is served and what it probes."""

    host: str
    port: int
    token: str | None  # None: generated for a non-loopback bind
    probe: str = "The quick brown fox"  # the prompt run every `every` steps
    every: int = 10
    start_paused: bool = False  # wait for the page before the first step


def add_serve_subcommand(cmds) -> None:
    p = cmds.add_parser("serve", help="live web UI: generate, look inside, perturb")
    p.add_argument("--load", default=None, help="checkpoint folder; default: ./ckpt, or train a tiny demo model")
    add_server_arguments(p, default_port=8765)
    add_layout_arguments(p)  # --nproc-per-node, TP/PP sizes, --device, --tokenizer-model, --bf16
    p.set_defaults(build_run=build_serve_run, launch=serve_main)


def add_server_arguments(p: argparse.ArgumentParser, default_port: int, prefix: str = "") -> None:
    p.add_argument(f"--{prefix}host", default="127.0.0.1", help="bind address (non-loopback needs a token)")
    p.add_argument(f"--{prefix}port", type=int, default=default_port, help="0: any free port")
    p.add_argument(f"--{prefix}token", default=None, help="access token (generated for non-loopback binds)")


def add_scope_ui_train_arguments(p: argparse.ArgumentParser) -> None:
    """`train --scope`: serve the training view from rank 0 of a one-process run."""
    p.add_argument("--scope", action="store_true", help="serve the MegaScope UI during training (one process)")
    add_server_arguments(p, default_port=8766, prefix="scope-")
    p.add_argument("--scope-probe", default=TrainingScopeConfig.probe, help="probe prompt shown every K steps")
    p.add_argument("--scope-every", type=int, default=TrainingScopeConfig.every, help="probe every K steps")
    p.add_argument("--scope-start-paused", action="store_true", help="wait for the page before the first step")


def build_training_scope_config(args: argparse.Namespace):
    """From the --scope* flags; None without --scope."""
    if not args.scope:
        return None
    return TrainingScopeConfig(
        args.scope_host, args.scope_port, args.scope_token, args.scope_probe, args.scope_every, args.scope_start_paused
    )


def server_config(host: str, port: int, token: str | None):
    from megatronapp.scope_ui.server import ServerConfig, resolve_token

    check_port(port)
    return ServerConfig(host=host, port=port, token=resolve_token(host, token))


def find_demo_checkpoint(train_if_missing: bool) -> str:
    for path in DEMO_CHECKPOINTS:
        if os.path.isfile(os.path.join(path, "latest")):
            return path
    if not os.path.isfile(TINY_DEMO_DIR / "latest") and train_if_missing:
        print(f"no --load given and no ./ckpt: training a tiny demo model into {TINY_DEMO_DIR} (~1 min)", flush=True)
        code = subprocess.call(
            [sys.executable, "-m", "megatronapp.cli.main", "train", *TINY_DEMO_TRAIN, "--save", str(TINY_DEMO_DIR)]
        )
        if code != 0:
            raise ConfigError("training the demo model failed; pass --load CKPT")
    return str(TINY_DEMO_DIR)


def build_generation_backend(load: str, tokenizer_model, device, bf16: bool, limits, model=None):
    """The UI's GenerationRunner over `model` (default: the whole model in this process)."""
    import torch

    from megatronapp.data.tokenizer import load_tokenizer
    from megatronapp.inference.model import build_inference_model, read_model_config
    from megatronapp.parallel.groups import single_process_groups
    from megatronapp.scope_ui.runner import GenerationRunner

    if model is None:
        dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        model = build_inference_model(
            read_model_config(load),
            single_process_groups(),
            dev,
            load_dir=load,
            dtype=torch.bfloat16 if bf16 else torch.float32,
        )
        # Decode steps replayed as a CUDA graph with the UI's capture recorded inside them; runs
        # with a perturbation that hooks activations fall back to eager (and say so in the log).
        model.cuda_graphs = dev.type == "cuda"
    return GenerationRunner(model, load_tokenizer(tokenizer_model), limits)


def check_port(port: int) -> None:
    if not 0 <= port < 65536:
        raise ConfigError(f"port must be in 0..65535, got {port}")


def build_serve_run(args):
    """The run of `scope serve`: args.load, or the demo checkpoint (trained here when missing)."""
    if args.load is None and (args.nproc_per_node or 1) > 1:
        raise ConfigError("--nproc-per-node needs --load (the demo model is served by one process)")
    check_port(args.port)  # before a missing demo checkpoint is trained
    load = args.load or find_demo_checkpoint(train_if_missing=not under_launcher())
    return build_inference_run(args, with_prompts=False, load=load, port=args.port, host=args.host, token=args.token)


def serve_main(run, argv: list[str]) -> int:
    cfg, load = server_config(run.host, run.port, run.token), run.load
    if not under_launcher() and (run.nproc_per_node or 1) > 1:
        return run_local_ranks("megatronapp.cli.main", rank_argv(argv), run.nproc_per_node)
    if under_launcher():
        return _serve_ranks(run, cfg)
    return _serve(build_generation_backend(load, run.tokenizer_model, run.device, run.bf16, cfg.limits), cfg, load)


def _serve(backend, cfg, load: str) -> int:
    from megatronapp.scope_ui.server import Hub, RunningServer

    try:
        server = RunningServer(Hub(backend, cfg.limits), cfg)
    except (ConfigError, ValueError, OSError) as exc:
        print(f"megatronapp: error: {exc}", file=sys.stderr)
        return 2
    try:  # a Ctrl-C may come as soon as the line is out, before uvicorn handles signals
        print(f"MegaScope UI ({load}): {server.url}  (Ctrl-C stops it)", flush=True)
        server.run()
    except KeyboardInterrupt:  # uvicorn shuts down on the first Ctrl-C, then re-raises it
        server.sock.close()
        print("MegaScope UI stopped", flush=True)
    return 0


def _serve_ranks(run, cfg) -> int:
    """Under the launcher: rank 0 serves and leads, the other ranks follow (scope_ui/ranks.py)."""
    from megatronapp.inference.launch import finish_worker, start_worker
    from megatronapp.scope_ui.ranks import JobChannel, LeaderRunner, follow

    model, load = start_worker(run), run.load
    runner = build_generation_backend(load, run.tokenizer_model, None, run.bf16, cfg.limits, model=model)
    channel = JobChannel(model.device)
    try:
        if model.groups.rank != 0:
            follow(runner, channel)
            return 0
        leader = LeaderRunner(runner, channel)
        try:
            return _serve(leader, cfg, load)
        finally:
            leader.stop()
    finally:
        finish_worker()
