"""`megatronapp train` flags (Megatron-LM's names) and their translation into configs.

Defaults live in one place, the config dataclasses (config/): every flag that sets a
field of one of the job's component configs (train, optimizer, precision, checkpoint,
logging, integrity) is named by that field, defaults to None here, and only the flags a user
gave are passed on (job.build_job routes each to its component), so the dataclass default
applies otherwise. `--help` shows those defaults, read from the
dataclasses.
"""

from __future__ import annotations

import argparse

from megatronapp.cli.architecture_args import add_architecture_arguments, compute_query_groups_override
from megatronapp.config import (
    ATTENTION_BACKENDS,
    MODEL_PRESETS,
    RECOMPUTE_GRANULARITIES,
    RECOMPUTE_METHODS,
    RERUN_MODES,
    SCHEDULES,
    STATE_DTYPE_CHOICES,
    ConfigError,
    JobConfig,
    ModelConfig,
    build_layout,
    model_preset,
)
from megatronapp.data.config import add_data_arguments
from megatronapp.dpp.config import DPP_FLAGS, DppConfig
from megatronapp.dpp.rebalance import REBALANCE_FLAGS, RebalanceConfig
from megatronapp.fbd.cli import build_role_layout
from megatronapp.fbd.config import FBD_FLAGS, FBD_SWITCH, FbdConfig
from megatronapp.flags import add_flags, read_flags
from megatronapp.job import FIELD_COMPONENTS, build_job, field_default
from megatronapp.launch.flags import DEVICE, LAYOUT_FLAGS, NPROC_PER_NODE, TOKENIZER_MODEL, VIRTUAL_STAGES
from megatronapp.launch.local import RESULT_FILE
from megatronapp.parallel.fp8 import AMAX_COMPUTE_ALGOS, FP8_FORMATS, FP8_RECIPES
from megatronapp.parallel.layout import ParallelLayout
from megatronapp.parallel.partition import PartitionError, compute_stage_layers
from megatronapp.scan.analyze.detect_config import DETECT_FLAGS, DetectConfig
from megatronapp.scan.record.trace_config import TRACE_FLAGS, TRACE_SWITCH, TraceConfig

_MODEL_FLAGS = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "ffn_hidden_size",
    "seq_length",
    "make_vocab_size_divisible_by",
    "hidden_dropout",
    "attention_dropout",
    "normalization",
    "layernorm_epsilon",
    "swiglu",
    "num_query_groups",
    "add_bias_linear",
    "add_qkv_bias",
    "untie_embeddings_and_output_weights",
    "rotary_base",
)


def _job_flag(g, flag: str, help: str = "", **kw) -> None:
    """A flag for the field of one of the job's component configs that its dest names: default
    None here, so the dataclass default applies unless the flag is given."""
    dest = flag.lstrip("-").replace("-", "_")
    if kw.get("action") not in ("store_true", "store_false", argparse.BooleanOptionalAction):
        help = f"{help} (default: {field_default(dest)})".strip()
    g.add_argument(flag, dest=dest, default=None, help=help, **kw)


def _add_integrity_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("step checks, reruns, determinism (Megatron's; engine/integrity.py, engine/rerun.py)")
    _job_flag(
        g,
        "--check-for-nan-in-loss-and-grad",
        "a non-finite loss or grad norm skips the update; the rank and parameter are named (default)",
        action=argparse.BooleanOptionalAction,
    )
    _job_flag(
        g, "--check-for-spiky-loss", "flag a loss above median + factor x MAD of recent steps", action="store_true"
    )
    _job_flag(
        g,
        "--check-for-large-grads",
        "flag a grad norm above median + factor x MAD of recent steps",
        action="store_true",
    )
    _job_flag(g, "--spiky-loss-factor", "band width in scaled MADs", type=float)
    _job_flag(g, "--large-grads-factor", "band width in scaled MADs", type=float)
    _job_flag(g, "--check-window", "recent accepted steps in the band", type=int)
    _job_flag(g, "--check-min-history", "steps before the band is used", type=int)
    _job_flag(
        g,
        "--rerun-mode",
        "validate_results: check each step before its update (on the device), re-execute a flagged "
        "step from the same weights at the log interval and classify it transient or reproducible; "
        "report_stats: execute every --rerun-stats-interval-th step twice and report the differences",
        choices=RERUN_MODES,
    )
    _job_flag(g, "--rerun-stats-interval", "report_stats: every N-th step", type=int)
    _job_flag(
        g, "--skip-spiky-batches", "validate_results: a reproducibly flagged step is not applied", action="store_true"
    )
    _job_flag(
        g,
        "--deterministic",
        "bit-identical reruns: deterministic kernels and attention, fixed "
        "NCCL algorithm (Megatron's --deterministic-mode)",
        action="store_true",
    )
    g.add_argument(
        "--deterministic-mode", dest="deterministic", action="store_true", default=None, help=argparse.SUPPRESS
    )


def _given_job_fields(args: argparse.Namespace) -> dict:
    """The component-config fields whose flags were given (every such flag's dest is the field's name)."""
    names = (n for cls in FIELD_COMPONENTS.values() for n in cls.__dataclass_fields__)
    return {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("launch")
    add_flags(g, (NPROC_PER_NODE,))
    g.add_argument("--nnodes", type=int, default=1, help="nodes, when launching through this command")
    add_flags(g, (DEVICE,))
    g.add_argument("--print-config", action="store_true", help="print the resolved configuration and exit")
    add_flags(g, (RESULT_FILE,), hidden=True)

    g = p.add_argument_group("parallelism")
    add_flags(g, LAYOUT_FLAGS, ParallelLayout)
    vpp = g.add_mutually_exclusive_group()  # Megatron's two spellings of the virtual stage count
    vpp.add_argument(
        "--num-layers-per-virtual-pipeline-stage",
        type=int,
        default=None,
        help="interleaved pipeline: layers per model chunk (default: one chunk per stage)",
    )
    add_flags(vpp, (VIRTUAL_STAGES,))
    g.add_argument(
        "--decoder-first-pipeline-num-layers",
        type=int,
        default=None,
        help="layers on the first pipeline stage; the rest split evenly (default: even split)",
    )
    g.add_argument(
        "--decoder-last-pipeline-num-layers",
        type=int,
        default=None,
        help="layers on the last pipeline stage; the rest split evenly (default: even split)",
    )
    g.add_argument(
        "--pipeline-stage-layers",
        type=_int_list,
        default=None,
        help="layers of every pipeline stage, e.g. 3,5,4,4 (one per pipeline rank, or one per virtual stage "
        "in Megatron's order chunk x PP + rank) (default: even split)",
    )
    g.add_argument(
        "--pipeline-schedule",
        choices=SCHEDULES,
        default=None,
        help="default: interleaved with virtual stages, else 1f1b",
    )
    _job_flag(
        g,
        "--sequence-parallel",
        "shard LayerNorm/dropout/residual regions along the sequence (needs TP > 1)",
        action="store_true",
    )
    _job_flag(
        g,
        "--overlap-grad-reduce",
        "overlap the DP reduction with backward (default)",
        action=argparse.BooleanOptionalAction,
    )
    _job_flag(
        g,
        "--split-backward",
        "run each backward as I (input gradient, sent upstream) and W "
        "(weight-gradient GEMMs, later); default: on for zb-h1, interleaved-zb and dynamic (W filling)",
        action=argparse.BooleanOptionalAction,
    )
    _job_flag(
        g,
        "--pipeline-recv-ahead",
        "static schedules: post receives ahead of the schedule's and send with single isends "
        "(CPU/gloo only; default: off)",
        action=argparse.BooleanOptionalAction,
    )
    _job_flag(
        g,
        "--gradient-accumulation-fusion",
        "bf16/fp16: weight-gradient GEMMs accumulate into the fp32 main grads (default)",
        action=argparse.BooleanOptionalAction,
    )
    _job_flag(
        g,
        "--fused-master-adamw",
        "bf16/fp16 on CUDA: AdamW on the fp32 master weights writes the model weights in the same kernel (default)",
        action=argparse.BooleanOptionalAction,
    )
    _job_flag(
        g,
        "--overlap-param-update",
        "CUDA: the fused master AdamW runs layer by layer on a side stream beside the next forward",
        action="store_true",
    )

    g = p.add_argument_group("model")
    g.add_argument("--model", choices=tuple(MODEL_PRESETS), default="demo", help="preset; flags below override")
    for flag in (
        "--num-layers",
        "--hidden-size",
        "--num-attention-heads",
        "--ffn-hidden-size",
        "--seq-length",
        "--make-vocab-size-divisible-by",
    ):
        g.add_argument(flag, type=int, default=None, help="default: the preset's")
    g.add_argument(
        "--hidden-dropout",
        type=float,
        default=None,
        help=f"default: the preset's (presets 0.0; Megatron's {ModelConfig.hidden_dropout})",
    )
    g.add_argument(
        "--attention-dropout",
        type=float,
        default=None,
        help=f"default: the preset's (presets 0.0; Megatron's {ModelConfig.attention_dropout})",
    )
    add_architecture_arguments(g)

    g = p.add_argument_group("training")
    for flag, kind in (
        ("--micro-batch-size", int),
        ("--global-batch-size", int),
        ("--train-iters", int),
        ("--lr", float),
        ("--min-lr", float),
        ("--lr-warmup-iters", int),
        ("--lr-decay-iters", int),
        ("--weight-decay", float),
        ("--adam-beta1", float),
        ("--adam-beta2", float),
        ("--adam-eps", float),
        ("--clip-grad", float),
        ("--seed", int),
    ):
        _job_flag(g, flag, type=kind)
    _job_flag(g, "--compile", "torch.compile each block's local math", action="store_true")
    _job_flag(g, "--recompute-granularity", "activation recompute", choices=RECOMPUTE_GRANULARITIES[1:])
    _job_flag(g, "--recompute-method", "for full recompute", choices=RECOMPUTE_METHODS)
    _job_flag(g, "--recompute-num-layers", "layers per group (uniform) or per chunk (block)", type=int)
    _job_flag(
        g, "--attention-backend", "preferred SDPA kernel (others remain as fallbacks)", choices=ATTENTION_BACKENDS
    )

    g = p.add_argument_group("mixed precision and optimizer (Megatron's; engine/mixed_precision.py)")
    _job_flag(g, "--bf16", "bf16 params/activations, fp32 main grads and master weights", action="store_true")
    _job_flag(g, "--fp16", "as --bf16 in fp16, with loss scaling", action="store_true")
    _job_flag(g, "--loss-scale", "static scale; default dynamic", type=float)
    _job_flag(g, "--initial-loss-scale", type=float)
    _job_flag(g, "--min-loss-scale", type=float)
    _job_flag(g, "--loss-scale-window", type=int)
    _job_flag(g, "--hysteresis", type=int)
    _job_flag(
        g,
        "--fp8-format",
        "FP8 GEMMs in the transformer layers (with --bf16/--fp16): e4m3 everywhere, or hybrid (E5M2 gradients)",
        choices=FP8_FORMATS,
    )
    _job_flag(
        g,
        "--fp8-recipe",
        "scaling recipe: tensorwise (current scaling) or delayed (scales from earlier "
        "steps' amaxes); power-of-two scales",
        choices=FP8_RECIPES,
    )
    _job_flag(g, "--fp8-amax-history-len", "delayed recipe: steps of amax history", type=int)
    _job_flag(
        g, "--fp8-amax-compute-algo", "delayed recipe: the scale's amax from the history", choices=AMAX_COMPUTE_ALGOS
    )
    _job_flag(g, "--fp8-margin", "delayed recipe: powers of two of headroom under the format's max", type=int)
    _job_flag(
        g,
        "--first-last-layers-bf16",
        "with --fp8-format: keep the first and last layers' GEMMs in bf16",
        action="store_true",
    )
    _job_flag(g, "--num-layers-at-start-in-bf16", "with --first-last-layers-bf16", type=int)
    _job_flag(g, "--num-layers-at-end-in-bf16", "with --first-last-layers-bf16", type=int)
    _job_flag(
        g,
        "--use-distributed-optimizer",
        "shard fp32 master weights and Adam state over DP (ZeRO-1)",
        action="store_true",
    )
    _job_flag(
        g,
        "--overlap-param-gather",
        "distributed optimizer: all-gather updated params during the next forward",
        action="store_true",
    )
    _job_flag(
        g,
        "--use-precision-aware-optimizer",
        "store masters and Adam moments at the dtypes below, update them in fp32 (Megatron-Core's)",
        action="store_true",
    )
    for name, choices in STATE_DTYPE_CHOICES.items():
        _job_flag(g, "--" + name.replace("_", "-"), "with --use-precision-aware-optimizer", choices=choices)
    _job_flag(
        g,
        "--store-param-remainders",
        "precision-aware, --bf16, fp32 masters: keep each master as its bf16 weight + a 16-bit remainder (default)",
        action="store_true",
    )
    g.add_argument(
        "--no-store-param-remainders",
        dest="store_param_remainders",
        action="store_false",
        default=None,
        help="keep whole fp32 master weights instead of the bf16 weight + remainder",
    )

    g = p.add_argument_group("data")
    g.add_argument(
        "--data-path",
        nargs="*",
        default=None,
        help=".txt / Megatron-style .jsonl files or folders, or Megatron indexed datasets: PREFIX "
        "(PREFIX.bin + PREFIX.idx) or a weighted blend W1 PREFIX1 W2 PREFIX2 ...; "
        "default: the embedded synthetic corpus",
    )
    add_flags(g, (TOKENIZER_MODEL,))
    add_data_arguments(g)

    g = p.add_argument_group("validation and test (Megatron's; engine/evaluation.py)")
    _job_flag(
        g,
        "--eval-interval",
        "validation loss every N steps and at the end, test loss at the end; no evaluation without it",
        type=int,
    )
    _job_flag(g, "--eval-iters", "global batches per evaluation, from the start of each stream", type=int)

    g = p.add_argument_group("checkpoints and logging")
    _job_flag(g, "--save")
    _job_flag(g, "--load", "resume from the latest checkpoint there; empty or missing: start fresh")
    _job_flag(g, "--save-interval", type=int)
    _job_flag(g, "--log-interval", "metrics reach the host every N steps", type=int)
    _job_flag(g, "--metrics-file", "JSON lines, one object per iteration")
    _job_flag(g, "--tensorboard-dir", "TensorBoard event files (pip install 'megatronapp[tensorboard]')")
    _job_flag(g, "--wandb-project", "Weights & Biases project, logged offline (pip install 'megatronapp[wandb]')")
    _job_flag(g, "--wandb-exp-name", "the W&B run's name")
    _job_flag(g, "--wandb-save-dir", "where W&B writes; when not given: SAVE/wandb with --save, else ./wandb")

    g = p.add_argument_group("MegaScan tracing")
    add_flags(g, (TRACE_SWITCH, *TRACE_FLAGS), TraceConfig)
    add_flags(g, DETECT_FLAGS, DetectConfig)
    _add_integrity_arguments(p)
    add_flags(p.add_argument_group("forward-backward disaggregation (MegaFBD)"), (FBD_SWITCH, *FBD_FLAGS), FbdConfig)
    g = p.add_argument_group("MegaDPP dynamic pipeline scheduling (--pipeline-schedule dynamic)")
    add_flags(g, DPP_FLAGS, DppConfig)
    g = p.add_argument_group("MegaDPP rebalancing (any pipeline schedule; dpp/rebalance.py)")
    add_flags(g, REBALANCE_FLAGS, RebalanceConfig)


def _positive(args, names) -> None:
    for n in names:
        v = getattr(args, n, None)
        if v is not None and v < 1:
            raise ConfigError(f"--{n.replace('_', '-')} must be >= 1, got {v}")


def check_flag_combinations(args: argparse.Namespace) -> None:
    """Combinations no config field can refuse on its own; one line each."""
    if args.recompute_granularity != "full" and (args.recompute_method or args.recompute_num_layers):
        raise ConfigError("--recompute-method / --recompute-num-layers need --recompute-granularity full")


def _model_config(args: argparse.Namespace, vocab_size: int | None) -> ModelConfig:
    overrides = {k: getattr(args, k) for k in _MODEL_FLAGS if getattr(args, k, None) is not None}
    overrides.update(compute_query_groups_override(args))
    if vocab_size is not None:
        overrides["vocab_size"] = vocab_size
    return model_preset(args.model, **overrides)


def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _partition(args: argparse.Namespace, model: ModelConfig, pp: int) -> tuple[int, tuple[int, ...]]:
    """Virtual stages per pipeline rank and the layers of each virtual stage (() when split evenly)."""
    first, last = args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers
    per_stage = args.pipeline_stage_layers or ()
    if first is None and last is None and not per_stage:
        return _virtual_stages(
            model, pp, args.num_layers_per_virtual_pipeline_stage, args.num_virtual_stages_per_pipeline_rank
        ), ()
    if args.num_layers_per_virtual_pipeline_stage:
        raise ConfigError(
            "--num-layers-per-virtual-pipeline-stage assumes an even split; for an uneven one with virtual "
            "stages give --pipeline-stage-layers with one count per virtual stage"
        )
    vpp = len(per_stage) // pp if per_stage and len(per_stage) > pp and len(per_stage) % pp == 0 else 1
    chunks = args.num_virtual_stages_per_pipeline_rank
    if chunks is not None and chunks != vpp:
        raise ConfigError(
            f"--num-virtual-stages-per-pipeline-rank {chunks} disagrees with the {vpp} virtual stage(s) per "
            "pipeline rank that the stage layer counts give"
        )
    try:
        counts = compute_stage_layers(model.num_layers, pp, vpp, first=first, last=last, per_stage=per_stage)
    except PartitionError as e:
        raise ConfigError(str(e)) from None
    return vpp, counts


def _virtual_stages(model: ModelConfig, pp: int, per: int | None, chunks: int | None = None) -> int:
    """Model chunks per pipeline rank, from layers per chunk or given directly; the layer count
    must divide either way (job.validate_job checks the latter)."""
    if chunks:
        return chunks
    if not per:
        return 1
    if model.num_layers % (pp * per):
        raise ConfigError(
            f"num layers {model.num_layers} is not divisible by pipeline-parallel size {pp} "
            f"x layers per virtual stage {per}"
        )
    return model.num_layers // (pp * per)


def build_fbd_config(args: argparse.Namespace) -> FbdConfig | None:
    """The MegaFBD config of the flags; None without --forward-backward-disaggregating."""
    if not args.forward_backward_disaggregating:
        return None
    return FbdConfig(
        forward_tp_size=args.forward_tensor_model_parallel_size or args.tensor_model_parallel_size,
        **read_flags(args, FBD_FLAGS),
    )


def layout_world_size(args: argparse.Namespace, world: int) -> int:
    """World of the engine's layout: all ranks, or the backward ranks under FBD (checked)."""
    fbd = build_fbd_config(args)
    if fbd is None:
        for flag in ("forward_tensor_model_parallel_size", "forward_device", "inject_crash"):
            if getattr(args, flag) is not None:
                raise ConfigError(f"--{flag.replace('_', '-')} needs --forward-backward-disaggregating")
        return world
    return build_role_layout(
        world, args.tensor_model_parallel_size, args.pipeline_model_parallel_size, fbd
    ).num_backward


def build_job_config(args: argparse.Namespace, world_size: int, vocab_size: int | None = None) -> JobConfig:
    """Translate parsed flags into a JobConfig for `world_size` processes; each config checks its
    own fields, cli/validate.py the job as a whole."""
    _positive(
        args,
        (
            "tensor_model_parallel_size",
            "pipeline_model_parallel_size",
            "num_layers_per_virtual_pipeline_stage",
            "num_virtual_stages_per_pipeline_rank",
            "nproc_per_node",
            "nnodes",
        ),
    )
    check_flag_combinations(args)
    model = _model_config(args, vocab_size)
    pp = args.pipeline_model_parallel_size
    vpp, stage_layers = _partition(args, model, pp)
    layout = build_layout(layout_world_size(args, world_size), args.tensor_model_parallel_size, pp, vpp, stage_layers)
    schedule = args.pipeline_schedule or ("interleaved" if vpp > 1 else "1f1b")
    return build_job(model, layout, **_given_job_fields(args), schedule=schedule)
