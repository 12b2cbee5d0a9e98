"""Configuration dataclasses, the one place their defaults are written: the model (with named
presets) and one config per component of a training job (schedule and batches, optimizer,
precision, checkpoints, logging, step checks), nested in JobConfig. One module per component;
every name is imported from here.

Each config checks its own fields when built. The rules between configs and against the
parallel layout are job.validate_job's, which the CLI calls before any process is launched,
so a bad combination fails with one line instead of a hang.
"""

from megatronapp.config.errors import ConfigError
from megatronapp.config.integrity import RERUN_MODES, IntegrityConfig
from megatronapp.config.job import JobConfig, build_layout
from megatronapp.config.model import (
    MODEL_PRESETS,
    NORMALIZATIONS,
    RECOMPUTE_GRANULARITIES,
    RECOMPUTE_METHODS,
    ModelConfig,
    RecomputeConfig,
    model_preset,
)
from megatronapp.config.optimizer import STATE_DTYPE_CHOICES, OptimizerConfig
from megatronapp.config.outputs import CheckpointConfig, EvalConfig, LoggingConfig
from megatronapp.config.precision import PrecisionConfig
from megatronapp.config.train import ATTENTION_BACKENDS, SCHEDULES, SPLIT_SCHEDULES, TrainConfig

__all__ = [
    "ATTENTION_BACKENDS",
    "CheckpointConfig",
    "ConfigError",
    "EvalConfig",
    "IntegrityConfig",
    "JobConfig",
    "LoggingConfig",
    "MODEL_PRESETS",
    "ModelConfig",
    "NORMALIZATIONS",
    "OptimizerConfig",
    "PrecisionConfig",
    "RECOMPUTE_GRANULARITIES",
    "RECOMPUTE_METHODS",
    "RERUN_MODES",
    "RecomputeConfig",
    "SCHEDULES",
    "SPLIT_SCHEDULES",
    "STATE_DTYPE_CHOICES",
    "TrainConfig",
    "build_layout",
    "model_preset",
]
