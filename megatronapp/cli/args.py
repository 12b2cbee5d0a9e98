"""`megatronapp train` flags (Megatron-LM's names) and their translation into configs."""

from __future__ import annotations

import argparse

from megatronapp.fbd.cli import add_fbd_arguments, check_fbd_job, layout_world_size
from megatronapp.config import (
    MODEL_PRESETS,
    SCHEDULES,
    ConfigError,
    JobConfig,
    TrainConfig,
    build_layout,
    model_preset,
    validate_job,
)


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("launch")
    g.add_argument("--nproc-per-node", type=int, default=None,
                   help="launch N local processes through torch.distributed.run (omit under torchrun)")
    g.add_argument("--nnodes", type=int, default=1, help="nodes, when launching through this command")
    g.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda when present")

    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None)
    g.add_argument("--pipeline-schedule", choices=SCHEDULES, default=None,
                   help="default: interleaved with virtual stages, else 1f1b")
    g.add_argument("--overlap-grad-reduce", dest="overlap_grad_reduce", action="store_true", default=True)
    g.add_argument("--no-overlap-grad-reduce", dest="overlap_grad_reduce", action="store_false")

    g = p.add_argument_group("model")
    g.add_argument("--model", choices=tuple(MODEL_PRESETS), default="demo", help="preset; flags below override")
    for flag in ("--num-layers", "--hidden-size", "--num-attention-heads", "--ffn-hidden-size", "--seq-length",
                 "--make-vocab-size-divisible-by"):
        g.add_argument(flag, type=int, default=None)

    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=2)
    g.add_argument("--global-batch-size", type=int, default=16)
    g.add_argument("--train-iters", type=int, default=100)
    g.add_argument("--lr", type=float, default=1e-3)
    g.add_argument("--min-lr", type=float, default=1e-4)
    g.add_argument("--lr-warmup-iters", type=int, default=10)
    g.add_argument("--lr-decay-iters", type=int, default=0)
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.95)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--bf16", action="store_true", help="bf16 mixed precision (GPU); fp32 otherwise")
    g.add_argument("--compile", action="store_true", help="torch.compile each block's local math")

    g = p.add_argument_group("data")
    g.add_argument("--data-path", nargs="*", default=None, help=".txt / Megatron-style .jsonl files or folders; "
                   "default: the embedded synthetic corpus")
    g.add_argument("--tokenizer-model", default=None, help="Hugging Face tokenizer.json; default: bytes")

    g = p.add_argument_group("checkpoints and logging")
    g.add_argument("--save", default=None)
    g.add_argument("--load", default=None)
    g.add_argument("--save-interval", type=int, default=0)
    g.add_argument("--log-interval", type=int, default=1)
    g.add_argument("--metrics-file", default=None, help="JSON lines, one object per iteration")

    g = p.add_argument_group("MegaScan tracing")
    g.add_argument("--trace", action="store_true", help="record a MegaScan trace of every rank")
    g.add_argument("--trace-dir", default="runs/trace")
    g.add_argument("--trace-interval", type=int, default=1, help="trace K iterations every N")
    g.add_argument("--continuous-trace-iterations", type=int, default=1)
    g.add_argument("--trace-granularity", choices=("base", "full"), default="base")
    g.add_argument("--inject-slowdown", action="append", default=[], metavar="RANK:FACTOR")
    g.add_argument("--inject-link-delay", action="append", default=[], metavar="SRC:DST:MS")
    add_fbd_arguments(p)


def _positive(args, names) -> None:
    for n in names:
        v = getattr(args, n)
        if v is not None and v < 1:
            raise ConfigError(f"--{n.replace('_', '-')} must be >= 1, got {v}")


def build_job_config(args: argparse.Namespace, world_size: int, vocab_size: int | None = None) -> JobConfig:
    """Translate parsed flags into a validated JobConfig for `world_size` processes."""
    _positive(args, ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                     "num_layers_per_virtual_pipeline_stage", "nproc_per_node", "nnodes"))
    overrides = {k: getattr(args, k) for k in ("num_layers", "hidden_size", "num_attention_heads",
                                               "ffn_hidden_size", "seq_length", "make_vocab_size_divisible_by")
                 if getattr(args, k) is not None}
    if vocab_size is not None:
        overrides["vocab_size"] = vocab_size
    model = model_preset(args.model, **overrides)
    pp, vpp = args.pipeline_model_parallel_size, 1
    if args.num_layers_per_virtual_pipeline_stage:
        per = args.num_layers_per_virtual_pipeline_stage
        if model.num_layers % (pp * per):
            raise ConfigError(f"num layers {model.num_layers} is not divisible by pipeline-parallel size {pp} "
                              f"x layers per virtual stage {per}")
        vpp = model.num_layers // (pp * per)
    schedule = args.pipeline_schedule or ("interleaved" if vpp > 1 else "1f1b")
    train = TrainConfig(
        micro_batch_size=args.micro_batch_size, global_batch_size=args.global_batch_size,
        train_iters=args.train_iters, lr=args.lr, min_lr=args.min_lr, lr_warmup_iters=args.lr_warmup_iters,
        lr_decay_iters=args.lr_decay_iters, weight_decay=args.weight_decay, adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2, adam_eps=args.adam_eps, clip_grad=args.clip_grad, seed=args.seed,
        schedule=schedule, bf16=args.bf16, compile=args.compile, overlap_grad_reduce=args.overlap_grad_reduce,
        log_interval=args.log_interval, save=args.save, load=args.load, save_interval=args.save_interval,
        metrics_file=args.metrics_file)
    layout = build_layout(layout_world_size(args, world_size), args.tensor_model_parallel_size, pp, vpp)
    job = JobConfig(model=model, train=train, layout=layout)
    validate_job(job)
    check_fbd_job(args, job, world_size)
    return job
