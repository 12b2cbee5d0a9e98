"""Every check a command's input must pass before anything is launched, in one place.

Each command turns its flags into a frozen description of what it will run (its
`build_run`, which parses flags and reads what the checks need from disk and the host: the
checkpoint's model fields, the tokenizer's vocabulary, the visible GPUs), then `cli.main`
calls `validate(run)` once, before any process starts. A broken rule raises a ValueError
(ConfigError and the components' own error classes are ValueErrors) whose message is one line;
`main` prints it and exits with code 2. What cannot be read cannot be checked: a missing
checkpoint or prompt file, or a flag that does not parse, is refused (in one line) by `build_run`.

    TrainRun      megatronapp train (cli/run.py): plain, --pipeline-schedule dynamic,
                  --forward-backward-disaggregating, --scope
    InferenceRun  megatronapp generate, scope capture (with a CaptureRequest), scope serve (with a port)
    TraceRun      megatronapp trace run
    ProbeRun      megatronapp trace probe
    ScheduleRun   megatronapp schedule simulate|show
    MergeRun, DetectRun, WhatIfRun, ReportRun, CheckRun
                  megatronapp trace merge|detect|whatif|report|check (scan/commands.py)
    ExportRun, ImportRun
                  megatronapp export hf, import hf (interop/cli.py)
    ScopeReportRun
                  megatronapp scope report
    PreprocessConfig
                  megatronapp preprocess-data

A checkpoint to load has every file it lists verified (sizes and checksums) here, once per
launch: the launching process notes in the environment what it verified (the files' sizes and
modification times), and its local ranks, which validate the same run again, skip what matches.

The rules themselves are the components' own pure checks (job.validate_job,
dpp.job_hooks.check_dpp_job, fbd.cli.check_fbd_job, ...), called here in the order a user meets them.
"""

from __future__ import annotations

import os
from pathlib import Path

import xxhash

from megatronapp.cli.devices import check_job_devices
from megatronapp.cli.injection import check_injection
from megatronapp.cli.metric_logs import check_metric_logs
from megatronapp.cli.preprocess import check_preprocess_run
from megatronapp.cli.run import TrainRun
from megatronapp.cli.train_eval import check_evaluation
from megatronapp.config import ConfigError
from megatronapp.data.dataset import check_text_files, check_token_id_files
from megatronapp.data.preprocess import PreprocessConfig
from megatronapp.data.sources import check_data_config, check_not_indexed_file_names, uses_indexed_data
from megatronapp.dpp.cli import ScheduleRun, check_schedule_run
from megatronapp.dpp.job_hooks import check_dpp_job, check_rebalance_job
from megatronapp.engine.checkpoint import compute_model_config_mismatch
from megatronapp.engine.checkpoint_files import verify_checkpoint_files
from megatronapp.fbd.cli import check_fbd_job
from megatronapp.inference.cli import InferenceRun, check_inference_layout_run, check_inference_prompts
from megatronapp.interop.cli import ExportRun, ImportRun, check_export_run, check_import_run
from megatronapp.job import validate_job
from megatronapp.launch.local import under_launcher
from megatronapp.scan.commands import (
    CheckRun,
    DetectRun,
    MergeRun,
    ReportRun,
    WhatIfRun,
    check_analysis_run,
    check_check_run,
    check_merge_run,
)
from megatronapp.scan.probe_run import ProbeRun, check_probe_run
from megatronapp.scan.trace_run import TraceRun, check_trace_run
from megatronapp.scope.cli import ScopeReportRun, check_capture, check_scope_report_run
from megatronapp.scope_ui.cli import check_port
from megatronapp.scope_ui.training import check_training_scope

VERIFIED_CHECKPOINT_ENV = "MEGATRONAPP_VERIFIED_CHECKPOINT"


def check_checkpoint_files(folder: str) -> None:
    """Every file of the checkpoint's iter_ `folder` against its recorded size and checksum
    (checkpoint_files.verify_checkpoint_files), unless this process or the one that launched it
    verified the same files unchanged since."""
    folder = Path(folder).resolve()
    listing = ",".join(f"{p.name}={p.stat().st_size}@{p.stat().st_mtime_ns}" for p in sorted(folder.iterdir()))
    stamp = xxhash.xxh3_64_hexdigest(f"{folder}:{listing}".encode())  # bounded size, whatever the world size
    if os.environ.get(VERIFIED_CHECKPOINT_ENV) == stamp:
        return
    verify_checkpoint_files(folder)
    os.environ[VERIFIED_CHECKPOINT_ENV] = stamp


def check_train_run(run: TrainRun) -> None:
    """Model x training x layout, MegaFBD, MegaDPP, devices, injections, MegaScope, checkpoint, data
    (indexed datasets: flags, file headers and split sizes, data/sources.py), evaluation, TensorBoard / W&B."""
    job = run.job
    validate_job(job)
    if run.fbd is not None:
        check_fbd_job(run.fbd, job, run.world_size)
    check_dpp_job(run.dpp, job)
    check_rebalance_job(run.dpp.rebalance, job, fbd=run.fbd is not None, scope=run.scope is not None)
    check_job_devices(job, run.world_size, run.device, run.fbd, run.visible_gpus, run.ranks_per_node)
    check_injection(run.injection, run.world_size, job.layout.world_size)
    check_training_scope(run.scope, run.world_size)
    if run.checkpoint_folder is not None:
        check_checkpoint_files(run.checkpoint_folder)
    if run.saved_model is not None:
        diff = compute_model_config_mismatch(run.saved_model, job.model)
        if diff:
            raise ConfigError(f"--load {job.checkpoint.load}: checkpoint model differs: {', '.join(diff)}")
    if uses_indexed_data(run.data):
        check_data_config(run.data, job.model.vocab_size)
    else:
        check_not_indexed_file_names(run.data_paths)
        for path in run.data_paths:
            if not os.path.exists(path):
                raise ConfigError(f"--data-path {path} does not exist")
        if run.data_paths and not under_launcher():  # the launching process reads them once for its ranks
            check_text_files(run.data_paths, "--data-path")
        _check_null_tokenizer_text(run)
    check_evaluation(run)
    check_metric_logs(job.logging)


def _check_null_tokenizer_text(run: TrainRun) -> None:
    """NullTokenizer reads ids written as text: the embedded corpus is prose, and text files must
    hold ids the vocabulary has."""
    if run.data.tokenizer_type != "NullTokenizer" or run.data.vocab_size is None:
        return
    if not run.data_paths:
        raise ConfigError(
            "--tokenizer-type NullTokenizer reads token ids written as text, and the embedded corpus is prose: "
            "give --data-path files of ids, or an indexed dataset"
        )
    if not under_launcher():
        check_token_id_files(run.data_paths, "--data-path", run.data.vocab_size)


def _check_inference(run: InferenceRun) -> None:
    """Layout and devices, scope capture's request, tokenizer and prompts, scope serve's port."""
    if run.checkpoint_folder is not None:
        check_checkpoint_files(run.checkpoint_folder)
    check_inference_layout_run(run)
    if run.capture is not None:
        check_capture(run.capture, run.model)
    check_inference_prompts(run)
    if run.port is not None:
        check_port(run.port)


_RULES = {
    TrainRun: check_train_run,
    InferenceRun: _check_inference,
    TraceRun: check_trace_run,
    ProbeRun: check_probe_run,
    ScheduleRun: check_schedule_run,
    MergeRun: check_merge_run,
    DetectRun: check_analysis_run,
    WhatIfRun: check_analysis_run,
    ReportRun: check_analysis_run,
    CheckRun: check_check_run,
    ExportRun: check_export_run,
    ImportRun: check_import_run,
    ScopeReportRun: check_scope_report_run,
    PreprocessConfig: check_preprocess_run,
}


def validate(run) -> None:
    """Check `run` (any of the runs in the module docstring) before anything is launched or written;
    a ValueError with a one-line message names the first rule it breaks."""
    for kind, check in _RULES.items():
        if isinstance(run, kind):
            return check(run)
    raise TypeError(f"no rules for {type(run).__name__}")
