"""One training job: every component config nested, and its parallel layout."""

from __future__ import annotations

from dataclasses import dataclass, field

from megatronapp.config.errors import ConfigError
from megatronapp.config.integrity import IntegrityConfig
from megatronapp.config.model import ModelConfig
from megatronapp.config.optimizer import OptimizerConfig
from megatronapp.config.outputs import CheckpointConfig, EvalConfig, LoggingConfig
from megatronapp.config.precision import PrecisionConfig
from megatronapp.config.train import TrainConfig
from megatronapp.parallel.layout import LayoutError, ParallelLayout


@dataclass(frozen=True)
class JobConfig:
    """One training job: the model, its layout, and one config per component of the engine."""

    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    layout: ParallelLayout = field(default_factory=lambda: ParallelLayout(world_size=1))
    integrity: IntegrityConfig = field(default_factory=IntegrityConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    @property
    def num_microbatches(self) -> int:
        return self.train.global_batch_size // (self.train.micro_batch_size * self.layout.dp_size)


def build_layout(
    world_size: int, tp_size: int, pp_size: int, virtual_pp_size: int = 1, stage_layers: tuple[int, ...] = ()
) -> ParallelLayout:
    try:
        return ParallelLayout(world_size, tp_size, pp_size, virtual_pp_size, stage_layers)
    except LayoutError as e:
        raise ConfigError(str(e)) from None
