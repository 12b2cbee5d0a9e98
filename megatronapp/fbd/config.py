"""MegaFBD settings: one frozen dataclass, the single source of its defaults and checks."""

from __future__ import annotations

from dataclasses import dataclass

from megatronapp.config import ConfigError, JobConfig
from megatronapp.flags import Flag


@dataclass(frozen=True)
class FbdInjection:
    """What tests and benchmarks do to an FBD job on purpose, apart from its FbdConfig (a training
    run sets only `crash`, from --inject-crash): faults that exercise failure handling and
    ordering, and an upper bound."""

    crash: tuple[int, int] | None = None  # (global rank, iteration): raise there (--inject-crash)
    random_delay_ms: float = 0.0  # sleep U(0, this) before every compute action, seeded per rank
    delay_seed: int = 0
    delayed_roles: tuple[str, ...] = ("forward", "backward")  # whose compute the delays hit
    free_forward: bool = False  # benchmarks' upper bound: forward workers send zeros, compute nothing

    def __post_init__(self) -> None:
        if self.random_delay_ms < 0:
            raise ConfigError(f"random_delay_ms must be >= 0, got {self.random_delay_ms}")

    def delay_ms(self, role: str) -> float:
        return self.random_delay_ms if role in self.delayed_roles else 0.0


@dataclass(frozen=True)
class FbdConfig:
    forward_tp_size: int = 1  # TF: tensor-parallel degree of forward workers
    forward_device: str | None = None  # "cpu" | "cuda"; None: the backward workers' device
    max_ahead: int = 2  # stage inputs a forward worker may send ahead of its backward twin's use

    def __post_init__(self) -> None:
        if self.forward_tp_size < 1:
            raise ConfigError(f"--forward-tensor-model-parallel-size must be >= 1, got {self.forward_tp_size}")
        if self.max_ahead < 1:
            raise ConfigError(f"--fbd-max-ahead must be >= 1, got {self.max_ahead}")
        if self.forward_device not in (None, "cpu", "cuda"):
            raise ConfigError(f"--forward-device must be cpu or cuda, got {self.forward_device!r}")


# `train`'s MegaFBD flags; --forward-tensor-model-parallel-size defaults to TP, so it sets no field
# directly (the run's builder reads it)
FBD_SWITCH = Flag(
    "--forward-backward-disaggregating",
    None,
    "forward workers (no autograd) stream stage inputs to backward workers, which "
    "recompute, run backward and own the optimizer",
    {"action": "store_true"},
)
FBD_FLAGS = (
    Flag(
        "--forward-tensor-model-parallel-size",
        None,
        "tensor-parallel size of forward workers (default: TP)",
        {"type": int, "metavar": "TF"},
    ),
    Flag(
        "--forward-device",
        "forward_device",
        "where forward workers compute (default: --device)",
        {"choices": ("cpu", "cuda")},
    ),
    Flag(
        "--fbd-max-ahead",
        "max_ahead",
        "microbatches a forward worker may run ahead of its backward twin",
        {"type": int, "metavar": "N"},
    ),
)


def parse_crash_spec(spec: str | None) -> tuple[int, int] | None:
    """'RANK:ITER' -> (rank, iteration); one-line ConfigError on bad input."""
    if spec is None:
        return None
    try:
        rank, iteration = (int(x) for x in spec.split(":"))
    except ValueError:
        raise ConfigError(f"--inject-crash expects RANK:ITER, got {spec!r}") from None
    if rank < 0 or iteration < 0:
        raise ConfigError(f"--inject-crash needs RANK >= 0 and ITER >= 0, got {spec!r}")
    return rank, iteration


def validate_fbd_job(job: JobConfig, cfg: FbdConfig, world_size: int) -> None:
    """Constraints FBD adds to a (backward-layout) job; ConfigError with one line."""
    m, tf = job.model, cfg.forward_tp_size
    if job.layout.virtual_pp_size != 1:
        raise ConfigError("forward-backward disaggregation does not support virtual pipeline stages")
    if job.train.schedule == "dynamic":
        raise ConfigError(
            "forward-backward disaggregation runs its own action lists: --pipeline-schedule dynamic does not apply"
        )
    if job.train.uses_split_backward():
        raise ConfigError("forward-backward disaggregation runs the whole backward: --split-backward does not apply")
    if job.precision.fp8_format is not None:
        raise ConfigError(
            "forward-backward disaggregation's forward ranks do not run FP8 GEMMs: --fp8-format does not apply"
        )
    if job.integrity.rerun_mode != "disabled":
        raise ConfigError(
            f"--rerun-mode {job.integrity.rerun_mode} executes a step again on each rank alone: a backward "
            "rank's rerun would wait for activations its forward rank does not send again (not with "
            "forward-backward disaggregation)"
        )
    for what, size in (
        ("num attention heads", m.num_attention_heads),
        ("num query groups", m.query_groups),
        ("ffn hidden size", m.ffn_size),
        ("padded vocab size", m.padded_vocab_size),
    ):
        if size % tf:
            raise ConfigError(f"{what} {size} is not divisible by forward tensor-parallel size {tf}")
    if m.attention_dropout and tf != job.layout.tp_size:
        raise ConfigError(
            f"attention dropout draws per-TP-rank streams: it needs forward TP size {tf} "
            f"= TP size {job.layout.tp_size} (hidden dropout works with any)"
        )
