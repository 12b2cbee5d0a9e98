"""Configuration dataclasses, the one place their defaults are written: the model (with named
presets) and one config per component of a training job (schedule and batches, optimizer,
precision, checkpoints, logging, step checks), nested in JobConfig. One module per component;
every name is imported from here.

Each config checks its own fields when built. The rules between configs and against the
parallel layout are job.validate_job's, which the CLI calls before any process is launched,
so a bad combination fails with one line instead of a hang.

Beside each component config are its `megatronapp train` flags (megatronapp/flags.py's `Flag`),
from which cli/args.py builds the train parser.
"""

from megatronapp.config.errors import ConfigError
from megatronapp.config.integrity import INTEGRITY_FLAGS, RERUN_MODES, IntegrityConfig
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
from megatronapp.config.optimizer import (
    OPTIMIZER_FLAGS,
    OPTIMIZER_PARALLELISM_FLAGS,
    OPTIMIZER_SCHEDULE_FLAGS,
    OPTIMIZER_STATE_FLAGS,
    STATE_DTYPE_CHOICES,
    OptimizerConfig,
)
from megatronapp.config.outputs import (
    CHECKPOINT_FLAGS,
    EVAL_FLAGS,
    LOGGING_FLAGS,
    CheckpointConfig,
    EvalConfig,
    LoggingConfig,
)
from megatronapp.config.precision import (
    MIXED_PRECISION_FLAGS,
    PRECISION_FLAGS,
    PRECISION_PARALLELISM_FLAGS,
    PrecisionConfig,
)
from megatronapp.config.train import (
    ATTENTION_BACKENDS,
    SCHEDULES,
    SPLIT_SCHEDULES,
    TRAIN_BATCH_FLAGS,
    TRAIN_FLAGS,
    TRAIN_PARALLELISM_FLAGS,
    TRAIN_STEP_FLAGS,
    TrainConfig,
)

__all__ = [
    "ATTENTION_BACKENDS",
    "CHECKPOINT_FLAGS",
    "CheckpointConfig",
    "ConfigError",
    "EVAL_FLAGS",
    "EvalConfig",
    "INTEGRITY_FLAGS",
    "IntegrityConfig",
    "JobConfig",
    "LOGGING_FLAGS",
    "LoggingConfig",
    "MIXED_PRECISION_FLAGS",
    "MODEL_PRESETS",
    "ModelConfig",
    "NORMALIZATIONS",
    "OPTIMIZER_FLAGS",
    "OPTIMIZER_PARALLELISM_FLAGS",
    "OPTIMIZER_SCHEDULE_FLAGS",
    "OPTIMIZER_STATE_FLAGS",
    "OptimizerConfig",
    "PRECISION_FLAGS",
    "PRECISION_PARALLELISM_FLAGS",
    "PrecisionConfig",
    "RECOMPUTE_GRANULARITIES",
    "RECOMPUTE_METHODS",
    "RERUN_MODES",
    "RecomputeConfig",
    "SCHEDULES",
    "SPLIT_SCHEDULES",
    "STATE_DTYPE_CHOICES",
    "TRAIN_BATCH_FLAGS",
    "TRAIN_FLAGS",
    "TRAIN_PARALLELISM_FLAGS",
    "TRAIN_STEP_FLAGS",
    "TrainConfig",
    "build_layout",
    "model_preset",
]
