"""Validation and test loss in `megatronapp train`: the streams, when they run, where they are shown.

    --eval-interval N   validation loss every N steps and at the end (unless the last step was
                        just evaluated); test loss at the end, where there is test data
    --eval-iters K      global batches per evaluation, from the start of each stream every time

Streams (data/eval_data.py): Megatron's valid and test splits of indexed data (--split, or
--valid-data-path / --test-data-path prefixes; data/sources.py); text files given as
--valid-data-path / --test-data-path; or, on the embedded synthetic corpus, held-out documents of
their own seed. Text training files are not split: with a text --data-path, validation needs
--valid-data-path (and test loss needs --test-data-path).
Results go to the terminal and the metrics file (rows {"iteration", "valid_loss", "valid_ppl"}
and {"iteration", "test_loss", "test_ppl"}) on rank 0, TensorBoard / W&B on the writing rank
(cli/metric_logs.py), the end-of-run summary and, with --scope, the training view's loss curve.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from megatronapp.config import ConfigError
from megatronapp.data.config import DEFAULT_SPLIT
from megatronapp.data.dataset import build_text_dataset, check_text_files
from megatronapp.data.eval_data import RestartableBatches, build_held_out_synthetic_dataset
from megatronapp.data.sources import build_datasets, compute_split_num_samples, split_has_documents, uses_indexed_data
from megatronapp.engine.evaluation import EvalBatches, EvalResult
from megatronapp.launch.local import under_launcher

EVAL_LABELS = {"valid": "validation", "test": "test"}


def check_evaluation(run) -> None:
    """Before launch (cli/validate.py): the evaluation flags against the data and the job; one line."""
    job = run.job
    given = [
        f
        for f, paths in (("--valid-data-path", run.valid_data_paths), ("--test-data-path", run.test_data_paths))
        if paths
    ]
    if not job.eval.enabled:
        if given:
            raise ConfigError(f"{given[0]} needs --eval-interval (evaluation is off without it)")
        return
    if run.fbd is not None:
        raise ConfigError("--eval-interval is not built for --forward-backward-disaggregating")
    if uses_indexed_data(run.data):  # the splits and their files are data/sources.py's checks
        if not split_has_documents(run.data, 1):
            where = (
                "--valid-data-path is not given"
                if run.data.has_per_split_paths
                else f"--split {run.data.split or DEFAULT_SPLIT}"
            )
            raise ConfigError(f"--eval-interval: the validation split holds no document ({where})")
        return
    if run.data_paths and not run.valid_data_paths:
        raise ConfigError("--eval-interval with --data-path needs --valid-data-path (the training files are not split)")
    for flag, paths in (("--valid-data-path", run.valid_data_paths), ("--test-data-path", run.test_data_paths)):
        for path in paths:
            if not os.path.exists(path):
                raise ConfigError(f"{flag} {path} does not exist")
        if paths and not under_launcher():  # the launching process reads them once for its ranks
            check_text_files(paths, flag)


def build_eval_streams(run, tokenizer, groups) -> dict[str, EvalBatches]:
    """This rank's evaluation streams by split ("valid", "test"); empty when evaluation is off."""
    job = run.job
    if not job.eval.enabled:
        return {}
    t, seq = job.train, job.model.seq_length
    geometry = dict(
        micro_batch_size=t.micro_batch_size,
        global_batch_size=t.global_batch_size,
        dp_rank=groups.dp_rank,
        dp_size=job.layout.dp_size,
        seed=t.seed,
    )
    if uses_indexed_data(run.data):
        counts = compute_split_num_samples(
            t.train_iters, t.global_batch_size, job.eval.eval_interval, job.eval.eval_iters
        )
        splits = build_datasets(run.data, seq_length=seq, seed=t.seed, num_samples=counts)
        found = {"valid": splits.valid, "test": splits.test}
        return {k: RestartableBatches(d, **geometry, shuffle=False) for k, d in found.items() if d is not None}
    streams = {}
    for split, paths in (("valid", run.valid_data_paths), ("test", run.test_data_paths)):
        if paths:
            dataset = build_text_dataset(tokenizer, list(paths), seq)
        elif not run.data_paths:
            samples = job.eval.eval_iters * t.global_batch_size
            dataset = build_held_out_synthetic_dataset(tokenizer, seq, t.seed, split, samples)
        else:
            continue
        streams[split] = RestartableBatches(dataset, **geometry)
    return streams


def describe_eval(result: EvalResult) -> str:
    """Megatron's line: `validation loss at iteration 100 | lm loss value: 5.1E+00 | lm loss PPL: 1.7E+02`."""
    return (
        f"{EVAL_LABELS.get(result.name, result.name)} loss at iteration {result.iteration} | "
        f"lm loss value: {result.loss:.6E} | lm loss PPL: {result.ppl:.6E} |"
    )


class RunEvaluations:
    """Runs the job's evaluations on a trainer (collective: every rank) and hands each result to
    `on_result` (the rank's reporting)."""

    def __init__(self, trainer, streams: dict[str, EvalBatches], on_result: Callable[[EvalResult], None]):
        self.trainer, self.streams, self.on_result = trainer, streams, on_result
        self.results: list[EvalResult] = []

    @property
    def on_eval(self):
        """Trainer.train's on_eval: validation at the interval (None without a validation stream)."""
        return self.at_interval if "valid" in self.streams else None

    def at_interval(self, iteration: int) -> None:
        self._run("valid")

    def at_end(self) -> None:
        """Validation unless this iteration was just evaluated, then test."""
        last = next((r for r in reversed(self.results) if r.name == "valid"), None)
        if "valid" in self.streams and (last is None or last.iteration != self.trainer.iteration):
            self._run("valid")
        if "test" in self.streams:
            self._run("test")

    def _run(self, split: str) -> None:
        result = self.trainer.evaluate(split, self.streams[split])
        self.results.append(result)
        self.on_result(result)
