"""TensorBoard and Weights & Biases logs of a training run (--tensorboard-dir, --wandb-project).

One rank writes them, as in Megatron: the first TP and DP rank of the last pipeline stage (every
rank knows the reduced metrics; that one holds the loss first). Scalars, by step (iteration):

    lm loss, learning-rate, grad-norm, loss-scale, skipped-iterations,
    throughput/tokens-per-s, throughput/tflops-per-gpu, mfu (on a known GPU),
    step-checks/nan, step-checks/spiky_loss, step-checks/large_grads (1: the step was flagged),
    lm loss validation, lm loss validation ppl, lm loss test, lm loss test ppl.

On resume, TensorBoard shows no step twice: the writer starts with purge_step = the first step
of this run, so readers drop what an earlier run wrote from that step on (a run that died after
its last checkpoint). W&B (offline; `wandb sync` uploads): the run id is kept in the save dir
and a resumed job logs into the same run (a new offline folder of that id); an offline run
cannot be rewound, so steps an earlier job logged after its last checkpoint stay in its folder.
"""

from __future__ import annotations

import importlib.util
import os
import secrets
from pathlib import Path

from megatronapp.config import ConfigError, LoggingConfig
from megatronapp.files import write_text_atomic

STEP_CHECK_FLAGS = ("nan", "spiky_loss", "large_grads")  # engine/integrity.py's flags
WANDB_RUN_ID_FILE = "megatronapp-wandb-run-id"


def check_metric_logs(log: LoggingConfig) -> None:
    """Before launch: the packages are installed and the folders writable; one-line ConfigError."""
    if log.tensorboard_dir is not None:
        if importlib.util.find_spec("tensorboard") is None:
            raise ConfigError("--tensorboard-dir needs the tensorboard package: pip install 'megatronapp[tensorboard]'")
        _check_writable_dir("--tensorboard-dir", log.tensorboard_dir)
    if log.wandb_project is None:
        if log.wandb_exp_name is not None or log.wandb_save_dir is not None:
            raise ConfigError("--wandb-exp-name / --wandb-save-dir need --wandb-project")
        return
    if importlib.util.find_spec("wandb") is None:
        raise ConfigError("--wandb-project needs the wandb package: pip install 'megatronapp[wandb]'")
    if log.wandb_save_dir is not None:
        _check_writable_dir("--wandb-save-dir", log.wandb_save_dir)


def _check_writable_dir(flag: str, path: str) -> None:
    """`path` is a folder we may write in, or can be made in its nearest existing parent."""
    p = Path(path).absolute()
    if p.exists() and not p.is_dir():
        raise ConfigError(f"{flag} {path} is not a folder")
    existing = next(a for a in (p, *p.parents) if a.exists())
    if not existing.is_dir():
        raise ConfigError(f"{flag} {path} is not writable ({existing} is a file)")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"{flag} {path} is not writable ({existing} does not let this user write)")


def writer_rank(layout) -> int:
    """The global rank that writes the logs: TP 0, DP 0 of the last pipeline stage."""
    return layout.rank_of(0, 0, layout.pp_size - 1)


def step_scalars(m: dict) -> dict[str, float]:
    """A metrics row's TensorBoard / W&B scalars (module docstring)."""
    out = {
        "lm loss": m["loss"],
        "learning-rate": m["lr"],
        "grad-norm": m["grad_norm"],
        "skipped-iterations": m["skipped_iterations"],
        "throughput/tokens-per-s": m["tokens_per_s"],
        "throughput/tflops-per-gpu": m["tflops_per_gpu"],
    }
    if m.get("loss_scale") is not None:
        out["loss-scale"] = m["loss_scale"]
    if m.get("mfu") is not None:
        out["mfu"] = m["mfu"]
    out.update({f"step-checks/{f}": float(f in m.get("flags", ())) for f in STEP_CHECK_FLAGS})
    return out


def eval_scalars(result) -> dict[str, float]:
    """An evaluation's scalars (engine/evaluation.py's EvalResult)."""
    label = {"valid": "validation"}.get(result.name, result.name)
    return {f"lm loss {label}": result.loss, f"lm loss {label} ppl": result.ppl}


class MetricLogs:
    """The TensorBoard writer and W&B run of the writing rank; `first_step` is this run's first
    iteration (1, or one past the resumed checkpoint's)."""

    def __init__(self, log: LoggingConfig, first_step: int, save: str | None = None, config: dict | None = None):
        self.tensorboard = self.wandb = None
        if log.tensorboard_dir is not None:
            from torch.utils.tensorboard import SummaryWriter

            # readers drop events an earlier run wrote from this run's first step on
            self.tensorboard = SummaryWriter(log.tensorboard_dir, purge_step=first_step)
        if log.wandb_project is not None:
            self.wandb = _start_wandb(log, first_step > 1, save, config or {})

    def log(self, step: int, scalars: dict[str, float]) -> None:
        if self.tensorboard is not None:
            for tag, value in scalars.items():
                self.tensorboard.add_scalar(tag, value, step)
        if self.wandb is not None:
            self.wandb.log(scalars, step=step)

    def flush(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.flush()

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.finish()


def _start_wandb(log: LoggingConfig, resuming: bool, save: str | None, config: dict):
    """An offline W&B run; a resumed training run continues the run whose id the save dir keeps."""
    import wandb

    save_dir = Path(log.wandb_save_dir or (Path(save) / "wandb" if save else "wandb"))
    save_dir.mkdir(parents=True, exist_ok=True)
    id_file = save_dir / WANDB_RUN_ID_FILE
    run_id = id_file.read_text().strip() if resuming and id_file.is_file() else None
    if run_id is None:
        run_id = secrets.token_hex(8)
        write_text_atomic(id_file, run_id + "\n")
    return wandb.init(
        project=log.wandb_project,
        name=log.wandb_exp_name,
        dir=str(save_dir),
        id=run_id,
        resume="allow",
        mode="offline",
        config=config,
    )


def build_metric_logs(job, rank: int, first_step: int, config: dict | None = None) -> MetricLogs | None:
    """This rank's MetricLogs, or None (not the writing rank, or no log asked for)."""
    log = job.logging
    if (log.tensorboard_dir is None and log.wandb_project is None) or rank != writer_rank(job.layout):
        return None
    return MetricLogs(log, first_step, job.checkpoint.save, config)
