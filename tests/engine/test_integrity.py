"""Engine integrity: throughput over the device's real time, per-step checks, reruns of flagged steps."""

from __future__ import annotations

import json
from dataclasses import asdict, replace

import pytest
import torch
from engine_jobs import RandomTokenBatches, make_job
from integrity_jobs import Corruption, integrity_job, train_deterministic, train_with_hook
from test_cli import run_cli

from megatronapp.config import ConfigError, IntegrityConfig
from megatronapp.engine.determinism import compute_deterministic_env, deterministic_attention_backend
from megatronapp.engine.integrity import (
    StepHistory,
    compute_band_upper,
    compute_differing_ranks,
    compute_rerun_verdict,
    compute_step_flags,
)
from megatronapp.engine.throughput import compute_run_throughput
from megatronapp.engine.trainer import Trainer
from megatronapp.job import validate_job
from megatronapp.parallel.groups import single_process_groups


class FakeDevice:
    """A clock and a device queue: enqueueing a step costs the host `host_s`, the device
    runs it for `device_s` after whatever is queued, and a sync waits for the queue."""

    def __init__(self, host_s: float, device_s: float):
        self.now, self.free_at, self.host_s, self.device_s = 0.0, 0.0, host_s, device_s

    def clock(self) -> float:
        return self.now

    def enqueue_step(self) -> None:
        self.free_at = max(self.free_at, self.now) + self.device_s
        self.now += self.host_s

    def sync(self) -> None:
        self.now = max(self.now, self.free_at)


def _device_bound_trainer(fake: FakeDevice, log_interval: int, iters: int) -> Trainer:
    job = make_job(1, iters=iters, global_batch=2, num_layers=1, log_interval=log_interval)
    trainer = Trainer(job, single_process_groups(), torch.device("cpu"), RandomTokenBatches(job, 0), clock=fake.clock)
    run_step, copy_to_host = trainer._run_step, trainer._copy_to_host

    def enqueued_step():
        fake.enqueue_step()
        return run_step()

    def synced_copy(steps):
        fake.sync()
        return copy_to_host(steps)

    trainer._run_step, trainer._copy_to_host = enqueued_step, synced_copy
    return trainer


@pytest.mark.parametrize("log_interval", [1, 3])
def test_step_time_is_the_devices_time_when_the_host_runs_ahead(log_interval):
    """The host enqueues a step in 10 ms, the device needs 100 ms: the accounting that reads
    the clock before the interval's sync reports 10 ms steps (and a 10x tokens/s)."""
    fake = FakeDevice(host_s=0.01, device_s=0.1)
    history = _device_bound_trainer(fake, log_interval, iters=6).train()
    assert [m.step_time_s for m in history] == pytest.approx([0.1] * 6)
    tokens_per_step = 2 * 16
    assert [m.tokens_per_s for m in history] == pytest.approx([tokens_per_step / 0.1] * 6)
    assert sum(m.step_time_s for m in history) == pytest.approx(fake.now)


def test_run_throughput_leaves_out_the_first_interval_and_weighs_by_time():
    rows = [
        {"iteration": i, "step_time_s": s, "tokens_per_s": 100 / s}
        for i, s in ((1, 5.0), (2, 5.0), (3, 1.0), (4, 1.0), (5, 3.0), (6, 3.0))
    ]
    step_s, tokens_per_s = compute_run_throughput(rows, log_interval=2)
    assert step_s == pytest.approx(2.0)
    assert tokens_per_s == pytest.approx(400 / 8.0)  # not the mean of 100 and 33.3
    assert compute_run_throughput(rows[:1], log_interval=2) == pytest.approx((5.0, 20.0))


# -- checks: pure decisions -----------------------------------------------------------------


def test_band_upper_is_median_plus_factor_scaled_mad():
    assert compute_band_upper([1.0, 2.0, 3.0, 4.0, 100.0], factor=2.0) == pytest.approx(3.0 + 2 * 1.4826 * 1.0)
    # flat history: the relative floor, not a zero-width band
    assert compute_band_upper([4.0] * 5, factor=10.0) == pytest.approx(4.0 + 10 * 4e-3)


def test_flags_need_the_history_and_count_only_the_upper_side():
    cfg = IntegrityConfig(check_for_spiky_loss=True, check_for_large_grads=True, check_min_history=3)
    losses, norms = [3.4, 3.3, 3.35], [2.9, 3.1, 3.0]
    assert compute_step_flags(10.7, 25.1, losses, norms, cfg) == ("spiky_loss", "large_grads")
    assert compute_step_flags(3.36, 3.0, losses, norms, cfg) == ()
    assert compute_step_flags(0.1, 0.01, losses, norms, cfg) == ()  # falling: training, not a fault
    assert compute_step_flags(10.7, 25.1, losses[:2], norms[:2], cfg) == ()  # warm-up
    assert compute_step_flags(float("nan"), 3.0, [], [], cfg) == ("nan",)
    assert compute_step_flags(3.3, float("inf"), [], [], replace(cfg, check_for_nan_in_loss_and_grad=False)) == ()


def test_history_keeps_flagged_and_non_finite_steps_out():
    cfg = IntegrityConfig(check_for_spiky_loss=True, check_min_history=3, check_window=4)
    h = StepHistory.build(cfg.check_window)
    for loss in (3.0, 3.1, 2.9, 50.0, float("nan"), 3.0, 3.05):
        h.judge(loss, 1.0, cfg)
    assert list(h.losses) == [3.1, 2.9, 3.0, 3.05]


def test_differing_ranks_are_bitwise_and_nan_equals_nan():
    nan = float("nan")
    assert compute_differing_ranks([(1.0, nan), (2.0, 3.0)], [(1.0, nan), (2.0, 3.0000002)]) == [1]
    assert compute_rerun_verdict([]) == "reproducible"
    assert compute_rerun_verdict([1]) == "transient"


def test_integrity_config_refuses_bad_values_in_one_line():
    with pytest.raises(ConfigError, match="rerun mode"):
        IntegrityConfig(rerun_mode="always")
    with pytest.raises(ConfigError, match="--skip-spiky-batches needs"):
        IntegrityConfig(skip_spiky_batches=True)


# -- checks and reruns in training ----------------------------------------------------------


def _clean_losses(iters: int = 10, world: int = 1, cluster=None, **layout) -> list[float]:
    job = integrity_job(world, iters=iters, **layout)
    if cluster is None:
        return [r["loss"] for r in train_with_hook(0, 1, job, None)["rows"]]
    return [r["loss"] for r in cluster.run(train_with_hook, world, job, None)[0]["rows"]]


def test_nan_grad_skips_the_update_and_names_the_parameter_at_the_log_interval():
    job = integrity_job(iters=4)
    out = train_with_hook(0, 1, job, Corruption(iteration=2, ranks=[0], nan=True))
    row = out["rows"][2]
    assert row["flags"] == ("nan",) and row["skipped_iterations"] == 1
    assert row["nonfinite"] == ({"rank": 0, "param": "embedding.weight", "loss_nonfinite": False},)
    assert all(torch.equal(a, b) for a, b in zip(out["params"][2], out["params"][3]))  # no update
    assert not any(torch.equal(a, b) for a, b in zip(out["params"][3], out["params"][4]))  # then training goes on
    assert out["rows"][3]["flags"] == () and out["rows"][3]["skipped_iterations"] == 1


def test_nan_check_off_lets_the_nan_through():
    job = integrity_job(iters=3, check_for_nan_in_loss_and_grad=False)
    out = train_with_hook(0, 1, job, Corruption(iteration=1, ranks=[0], nan=True))
    assert out["rows"][1]["skipped_iterations"] == 0
    assert any(torch.isnan(p).any() for p in out["params"][2])


@pytest.mark.parametrize("layout", [{"pp": 2}, {}], ids=["pp2", "dp2"])
def test_nan_on_one_rank_skips_every_rank_and_is_named_with_that_rank(cluster, layout):
    """dp2: the NaN is put in after the DP reduction, on rank 1 only: rank 0 must skip too."""
    job = integrity_job(2, iters=3, **layout)
    reports = cluster.run(train_with_hook, 2, job, Corruption(iteration=1, ranks=[1], nan=True))
    for rep in reports:
        assert rep["rows"][1]["flags"] == ("nan",)
        found = rep["rows"][1]["nonfinite"]
        assert [f["rank"] for f in found] == [1] and found[0]["param"].startswith("layers." if layout else "emb")
        assert all(torch.equal(a, b) for a, b in zip(rep["params"][1], rep["params"][2]))


CHECKS = dict(check_for_spiky_loss=True, check_for_large_grads=True, rerun_mode="validate_results")


def test_one_step_corruption_is_rerun_classified_transient_and_training_matches_a_clean_run():
    job = integrity_job(iters=10, **CHECKS)
    out = train_with_hook(0, 1, job, Corruption(iteration=7, ranks=[0], loss_add=100.0, grad_scale=1e3))
    flagged = [r for r in out["rows"] if r["flags"]]
    assert [r["iteration"] for r in flagged] == [8]
    assert flagged[0]["rerun"] == {
        "flag": ["spiky_loss", "large_grads"],
        "verdict": "transient",
        "ranks": [0],
        "deterministic": False,
        "spread": {"loss": 0.0, "grad_norm": 0.0},  # two more executions agree: the first one was off
    }
    assert [r["loss"] for r in out["rows"]] == _clean_losses(10)
    assert out["marks"] == [(7, "rerun", {"verdict": "transient", "flag": "spiky_loss,large_grads"})]


def test_reproducibly_bad_batch_is_classified_reproducible_and_can_be_skipped():
    hook = Corruption(iteration=7, ranks=[0], every_attempt=True, grad_scale=1e3)
    out = train_with_hook(0, 1, integrity_job(iters=9, **CHECKS), hook)
    assert out["rows"][7]["rerun"] == {
        "flag": ["large_grads"],
        "verdict": "reproducible",
        "ranks": [],
        "deterministic": False,
    }
    assert out["rows"][7]["skipped_iterations"] == 0
    skipped = train_with_hook(0, 1, integrity_job(iters=9, skip_spiky_batches=True, **CHECKS), hook)
    assert skipped["rows"][7]["rerun"]["skipped"] and skipped["rows"][7]["skipped_iterations"] == 1
    assert all(torch.equal(a, b) for a, b in zip(skipped["params"][7], skipped["params"][8]))


def test_transient_fault_on_one_data_parallel_rank_names_that_rank(cluster):
    job = integrity_job(2, iters=9, **CHECKS)
    reports = cluster.run(train_with_hook, 2, job, Corruption(iteration=6, ranks=[1], grad_scale=1e3))
    clean = _clean_losses(9, world=2, cluster=cluster)
    for rep in reports:
        assert {k: rep["rows"][6]["rerun"][k] for k in ("flag", "verdict", "ranks")} == {
            "flag": ["large_grads"],
            "verdict": "transient",
            "ranks": [1],
        }
        assert [r["loss"] for r in rep["rows"]] == clean


def test_report_stats_reruns_every_nth_step_and_finds_no_difference_on_the_cpu():
    out = train_with_hook(0, 1, integrity_job(iters=6, rerun_mode="report_stats", rerun_stats_interval=3), None)
    reruns = [(r["iteration"], r["rerun"]) for r in out["rows"] if r["rerun"]]
    assert reruns == [
        (i, {"mode": "report_stats", "ranks": [], "loss_delta": 0.0, "grad_norm_delta": 0.0}) for i in (3, 6)
    ]
    assert [r["loss"] for r in out["rows"]] == _clean_losses(6)


def test_band_checks_without_rerun_flag_at_the_log_interval():
    job = integrity_job(iters=10, check_for_spiky_loss=True)
    trainer_rows = train_with_hook(0, 1, job, Corruption(iteration=7, ranks=[0], loss_add=100.0))["rows"]
    assert [r["iteration"] for r in trainer_rows if r["flags"]] == [8]
    assert trainer_rows[7]["rerun"] is None


# -- command line -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, message",
    [
        (["--rerun-mode", "always"], "argument --rerun-mode: invalid choice: 'always'"),
        (["--skip-spiky-batches"], "--skip-spiky-batches needs --rerun-mode validate_results"),
        (["--check-window", "3", "--check-min-history", "5"], "need 2 <= check_min_history (5) <= check_window (3)"),
    ],
)
def test_bad_integrity_flags_fail_in_one_line(args, message):
    res = run_cli(args, timeout=60)
    assert res.returncode == 2, res.stderr
    lines = [line for line in res.stderr.strip().splitlines() if line]
    assert len(lines) == 1 and message in lines[0], res.stderr


def test_integrity_flags_reach_the_config_and_defaults_come_from_the_dataclass():
    res = run_cli(
        [
            "--print-config",
            "--no-check-for-nan-in-loss-and-grad",
            "--check-for-spiky-loss",
            "--rerun-mode",
            "report_stats",
            "--deterministic-mode",
        ],
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    cfg = json.loads(res.stdout)["integrity"]
    assert cfg == {
        **asdict(IntegrityConfig()),
        "check_for_nan_in_loss_and_grad": False,
        "check_for_spiky_loss": True,
        "rerun_mode": "report_stats",
        "deterministic": True,
    }


def test_cli_run_with_checks_and_rerun_writes_the_fields(tmp_path):
    metrics = tmp_path / "m.jsonl"
    res = run_cli(
        [
            "--train-iters",
            "3",
            "--global-batch-size",
            "2",
            "--check-for-spiky-loss",
            "--check-for-large-grads",
            "--rerun-mode",
            "report_stats",
            "--rerun-stats-interval",
            "2",
            "--metrics-file",
            str(metrics),
        ]
    )
    assert res.returncode == 0, res.stderr
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["flags"] for r in rows] == [[], [], []]
    assert [r["rerun"] is not None for r in rows] == [False, True, False]


def test_rerun_step_is_marked_on_the_megascan_timeline(tmp_path):
    from megatronapp.scan.record.format import load_rank_trace
    from megatronapp.scan.record.tracer import TraceConfig, Tracer

    meta = {
        "rank": 0,
        "world_size": 1,
        "coords": {"tp": 0, "dp": 0, "pp": 0},
        "layout": {"tp_size": 1, "pp_size": 1, "dp_size": 1, "virtual_pp_size": 1},
        "run_id": "t",
    }
    tracer = Tracer(TraceConfig(enabled=True, trace_dir=str(tmp_path), interval=1), meta)
    job = integrity_job(iters=9, **CHECKS)
    trainer = Trainer(
        job,
        single_process_groups(),
        torch.device("cpu"),
        RandomTokenBatches(job, 0),
        tracer=tracer,
        step_hook=Corruption(iteration=7, ranks=[0], loss_add=100.0),
    )
    trainer.train()
    tracer.close()
    rows = load_rank_trace(tracer.path).events.to_pylist()
    marks = [r for r in rows if r["cat"] == "user"]
    assert [(r["iteration"], r["name"]) for r in marks] == [(7, "rerun verdict=transient flag=spiky_loss")]
    step = [r for r in rows if r["cat"] == "step" and r["iteration"] == 7][-1]  # the rerun's
    assert marks[0]["start_ns"] == marks[0]["end_ns"] >= step["end_ns"]


# -- --deterministic --------------------------------------------------------------------------


def test_deterministic_env_sets_only_what_is_missing_or_not_accepted():
    assert compute_deterministic_env({}) == {
        "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
        "NCCL_ALGO": "Ring",
        "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0",
    }
    assert (
        compute_deterministic_env(
            {"CUBLAS_WORKSPACE_CONFIG": ":16:8", "NCCL_ALGO": "Tree", "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0"}
        )
        == {}
    )
    assert compute_deterministic_env(
        {"NCCL_ALGO": "NVLS", "CUBLAS_WORKSPACE_CONFIG": ":4096:8", "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0"}
    ) == {"NCCL_ALGO": "Ring"}


def test_deterministic_attention_and_unprepared_process_are_refused():
    assert deterministic_attention_backend("auto") == "flash"
    with pytest.raises(ConfigError, match="not cudnn"):
        deterministic_attention_backend("cudnn")
    with pytest.raises(ConfigError, match="not cudnn"):
        validate_job(
            replace(
                integrity_job(),
                integrity=IntegrityConfig(deterministic=True),
                train=replace(integrity_job().train, attention_backend="cudnn"),
            )
        )
    job = replace(integrity_job(), integrity=IntegrityConfig(deterministic=True))
    with pytest.raises(ConfigError, match="enable_deterministic_mode"):
        Trainer(job, single_process_groups(), torch.device("cpu"), RandomTokenBatches(job, 0))


@pytest.mark.parametrize("world, tp, pp", [(4, 2, 2), (2, 1, 1)])
def test_deterministic_runs_are_bit_identical(cluster, world, tp, pp):
    job = replace(
        make_job(world, tp, pp, iters=3, model_kw={"hidden_dropout": 0.1}),
        integrity=IntegrityConfig(deterministic=True),
    )
    first, second = (cluster.run(train_deterministic, world, job) for _ in range(2))
    for a, b in zip(first, second):
        assert a["losses"] == b["losses"] and a["norms"] == b["norms"]
        assert a["grads"].keys() == b["grads"].keys()
        for name, (g, _, _) in a["grads"].items():
            assert torch.equal(g, b["grads"][name][0]), name


# -- comparing runs' metrics: bit-for-bit, and the flagged steps ---------------------------------


def test_runs_compare_bit_for_bit_and_flagged_steps_are_tabulated():
    from megatronapp.engine.integrity import compare_runs, tabulate_flagged

    rows = [{"iteration": i, "loss": 3.0 + i * 1e-7, "grad_norm": 2.0, "flags": [], "rerun": None} for i in (1, 2, 3)]
    assert compare_runs(rows, [dict(r) for r in rows])["identical"]
    other = [dict(r) for r in rows]
    other[1]["grad_norm"] = 2.0000000000000004  # one ulp
    assert compare_runs(rows, other) == {
        "steps": 3,
        "identical": False,
        "first_differing_iteration": 2,
        "differing_steps": 1,
    }
    other[2].update(flags=["spiky_loss"], rerun={"flag": ["spiky_loss"], "verdict": "transient", "ranks": [0]})
    assert tabulate_flagged({"a": rows, "b": other}) == [
        {
            "run": "b",
            "iteration": 3,
            "flags": ["spiky_loss"],
            "loss": rows[2]["loss"],
            "grad_norm": 2.0,
            "verdict": "transient",
            "ranks": [0],
        }
    ]


# -- MegaScope's training view: a flagged step, layer by layer ------------------------------


def test_scope_view_compares_a_flagged_step_with_its_rerun_layer_by_layer():
    from test_scope_ui_training import _RecordingHub

    from megatronapp.data.tokenizer import load_tokenizer
    from megatronapp.scope_ui import protocol as P
    from megatronapp.scope_ui.training import TrainingScope

    job = integrity_job(iters=9, **CHECKS)
    hook = Corruption(iteration=7, ranks=[0], grad_scale=1e3)
    trainer = Trainer(job, single_process_groups(), torch.device("cpu"), RandomTokenBatches(job, 0), step_hook=hook)
    hook.only_params = {id(p) for name, p in trainer.chunks[0].named_parameters() if name.startswith("layers.1.")}
    scope = TrainingScope(trainer, load_tokenizer(None), "The quick", 100, 4)
    scope.hub = hub = _RecordingHub()
    try:
        trainer.train(on_step=scope.wrap(lambda m: None))
    finally:
        scope.close()
    assert trainer.replay_observer is None
    (rerun,) = [m for m in hub.messages if isinstance(m, P.TrainRerun)]
    assert (rerun.iteration, rerun.flags, rerun.verdict, rerun.ranks) == (7, ["large_grads"], "transient", [0])
    ratios = [f / r for f, r in zip(rerun.layer_grad_norms_flagged, rerun.layer_grad_norms_rerun)]
    # the unfused (CPU) update clips the grads in place: both layers share one factor, layer 1 stands out
    assert ratios[1] / ratios[0] == pytest.approx(1e3, rel=1e-4)
    assert len(rerun.layer_act_rms_rerun) == 2 and all(v > 0 for v in rerun.layer_act_rms_rerun)


def test_training_page_shows_the_flagged_step_against_its_rerun():
    from scope_ui_jobs import CHROMIUM_ARGS, TrainingServer, chromium_or_skip

    path = chromium_or_skip()
    from playwright.sync_api import sync_playwright

    torch.set_num_threads(1)
    job = integrity_job(iters=10**6, **CHECKS)
    hook = Corruption(iteration=7, ranks=[0], grad_scale=1e3)
    training = TrainingServer(
        Trainer(job, single_process_groups(), torch.device("cpu"), RandomTokenBatches(job, 0), step_hook=hook)
    )
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=path, args=CHROMIUM_ARGS)
            page = browser.new_page()
            page.set_default_timeout(60_000)
            page.goto(training.server.url)
            page.wait_for_selector("#rerun-stats")
            text = page.inner_text("#rerun-stats")
            browser.close()
    finally:
        training.stop()
    assert "step 8 flagged (large_grads): transient on ranks 0" in text, text  # sent to a tab opened later too


def test_cli_deterministic_runs_write_identical_metrics(tmp_path):
    rows = []
    for k in (1, 2):
        metrics = tmp_path / f"m{k}.jsonl"
        res = run_cli(
            [
                "--deterministic",
                "--train-iters",
                "3",
                "--global-batch-size",
                "4",
                "--hidden-dropout",
                "0.1",
                "--metrics-file",
                str(metrics),
            ]
        )
        assert res.returncode == 0, res.stderr
        rows.append([(r["loss"], r["grad_norm"]) for r in map(json.loads, metrics.read_text().splitlines())])
    assert rows[0] == rows[1] and len(rows[0]) == 3


def test_step_counters_advance_without_reading_the_skip_flag_on_the_host():
    """A 0-dim tensor passed where an op takes a Scalar is read on the host (an .item(), which
    on CUDA waits for the device every step); the counters must take the flag as a tensor."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from megatronapp.engine.master_adam import advance_step_counters

    class RecordOps(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    counters = [torch.zeros(()), torch.full((), 5.0)]
    for flag, want in ((0.0, [1.0, 6.0]), (1.0, [1.0, 6.0]), (0.0, [2.0, 7.0])):
        with RecordOps() as rec:
            advance_step_counters(counters, torch.tensor(flag))
        assert "_local_scalar_dense" not in rec.ops, rec.ops
        assert [float(c) for c in counters] == want
