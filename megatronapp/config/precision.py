"""Mixed precision and FP8."""

from __future__ import annotations

from dataclasses import dataclass

from megatronapp.config.errors import ConfigError
from megatronapp.flags import BOOLEAN_OPTIONAL, field_flag
from megatronapp.parallel.fp8 import AMAX_COMPUTE_ALGOS, FP8_FORMATS, FP8_RECIPES


@dataclass(frozen=True)
class PrecisionConfig:
    """Mixed precision as Megatron: bf16/fp16 params and activations, fp32 main grads and master
    weights (engine.mixed_precision). fp16 uses loss scaling: static when loss_scale is set, else
    dynamic (engine.grad_scaler). FP8 GEMMs in the transformer layers' linears (parallel/fp8.py),
    with bf16 or fp16: Megatron's --fp8-format e4m3|hybrid, --fp8-recipe tensorwise|delayed and
    the delayed recipe's amax history, compute algorithm and margin (Megatron's defaults)."""

    bf16: bool = False
    fp16: bool = False
    loss_scale: float | None = None
    initial_loss_scale: float = 2.0**32
    min_loss_scale: float = 1.0
    loss_scale_window: int = 1000
    hysteresis: int = 2
    fp8_format: str | None = None
    fp8_recipe: str = "tensorwise"
    fp8_amax_history_len: int = 1
    fp8_amax_compute_algo: str = "most_recent"
    fp8_margin: int = 0
    first_last_layers_bf16: bool = False  # Megatron's: the first / last layers' GEMMs stay bf16
    num_layers_at_start_in_bf16: int = 1
    num_layers_at_end_in_bf16: int = 1
    # bf16/fp16: weight-gradient GEMMs accumulate straight into the fp32 main grads
    # (Megatron's --gradient-accumulation-fusion, on by default there too; parallel/wgrad_fusion.py)
    gradient_accumulation_fusion: bool = True

    def __post_init__(self) -> None:
        if self.bf16 and self.fp16:
            raise ConfigError("--bf16 and --fp16 are mutually exclusive")
        if self.loss_scale is not None and self.loss_scale <= 0:
            raise ConfigError(f"loss_scale must be > 0, got {self.loss_scale}")
        if not 0 < self.min_loss_scale <= self.initial_loss_scale:
            raise ConfigError(
                f"need 0 < min_loss_scale ({self.min_loss_scale}) <= initial_loss_scale ({self.initial_loss_scale})"
            )
        for name in ("loss_scale_window", "hysteresis"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        self._check_fp8()

    @property
    def half(self) -> bool:
        """bf16 or fp16 params and activations."""
        return self.bf16 or self.fp16

    def fp8_layers(self, num_layers: int) -> range:
        """Global indices of the layers whose GEMMs run in FP8 (empty without --fp8-format).
        --first-last-layers-bf16 keeps the layers nearest the embedding and the output in bf16:
        they are the most sensitive to FP8's rounding (Megatron's option)."""
        if self.fp8_format is None:
            return range(0)
        if not self.first_last_layers_bf16:
            return range(num_layers)
        return range(self.num_layers_at_start_in_bf16, num_layers - self.num_layers_at_end_in_bf16)

    def _check_fp8(self) -> None:
        if self.fp8_format is not None:
            if self.fp8_format not in FP8_FORMATS:
                raise ConfigError(f"unknown fp8 format {self.fp8_format!r}; choose from {', '.join(FP8_FORMATS)}")
            if not self.half:
                raise ConfigError("--fp8-format needs --bf16 or --fp16 (FP8 GEMMs, the rest in bf16/fp16, as Megatron)")
        if self.first_last_layers_bf16 and self.fp8_format is None:
            raise ConfigError("--first-last-layers-bf16 needs --fp8-format")
        for name in ("num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.fp8_recipe not in FP8_RECIPES:
            raise ConfigError(f"fp8 recipe {self.fp8_recipe!r} is not built; choose from {', '.join(FP8_RECIPES)}")
        if self.fp8_amax_compute_algo not in AMAX_COMPUTE_ALGOS:
            raise ConfigError(
                f"unknown fp8 amax compute algo {self.fp8_amax_compute_algo!r}; choose from "
                f"{', '.join(AMAX_COMPUTE_ALGOS)}"
            )
        if self.fp8_amax_history_len < 1 or self.fp8_margin < 0:
            raise ConfigError(
                f"need fp8_amax_history_len >= 1 and fp8_margin >= 0, got "
                f"{self.fp8_amax_history_len} and {self.fp8_margin}"
            )


# `megatronapp train` flags for PrecisionConfig's fields (Megatron's names), one tuple per --help
# group they appear in (cli/args.py); PRECISION_FLAGS is all of them
PRECISION_PARALLELISM_FLAGS = (
    field_flag(
        "--gradient-accumulation-fusion",
        "bf16/fp16: weight-gradient GEMMs accumulate into the fp32 main grads (default)",
        action=BOOLEAN_OPTIONAL,
    ),
)
# half precision with its loss scaling, and FP8
MIXED_PRECISION_FLAGS = (
    field_flag("--bf16", "bf16 params/activations, fp32 main grads and master weights", action="store_true"),
    field_flag("--fp16", "as --bf16 in fp16, with loss scaling", action="store_true"),
    field_flag("--loss-scale", "static scale; default dynamic", type=float),
    field_flag("--initial-loss-scale", type=float),
    field_flag("--min-loss-scale", type=float),
    field_flag("--loss-scale-window", type=int),
    field_flag("--hysteresis", type=int),
    field_flag(
        "--fp8-format",
        "FP8 GEMMs in the transformer layers (with --bf16/--fp16): e4m3 everywhere, or hybrid (E5M2 gradients)",
        choices=FP8_FORMATS,
    ),
    field_flag(
        "--fp8-recipe",
        "scaling recipe: tensorwise (current scaling) or delayed (scales from earlier "
        "steps' amaxes); power-of-two scales",
        choices=FP8_RECIPES,
    ),
    field_flag("--fp8-amax-history-len", "delayed recipe: steps of amax history", type=int),
    field_flag(
        "--fp8-amax-compute-algo", "delayed recipe: the scale's amax from the history", choices=AMAX_COMPUTE_ALGOS
    ),
    field_flag("--fp8-margin", "delayed recipe: powers of two of headroom under the format's max", type=int),
    field_flag(
        "--first-last-layers-bf16",
        "with --fp8-format: keep the first and last layers' GEMMs in bf16",
        action="store_true",
    ),
    field_flag("--num-layers-at-start-in-bf16", "with --first-last-layers-bf16", type=int),
    field_flag("--num-layers-at-end-in-bf16", "with --first-last-layers-bf16", type=int),
)
PRECISION_FLAGS = (*PRECISION_PARALLELISM_FLAGS, *MIXED_PRECISION_FLAGS)
