"""The time budget (scan/analyze/budget.py, budget_summary.py) on synthetic traces whose every span
and counter is set by hand: the parts add up, each verdict follows from the signal that explains
it, and a link is judged only over messages whose ends were not descheduled."""

from __future__ import annotations

import json
import random

import pyarrow as pa
import pytest

from megatronapp.cli.main import main
from megatronapp.scan.analyze.budget import compute_budget
from megatronapp.scan.analyze.budget_summary import BudgetConfig, compute_budget_summary
from megatronapp.scan.record.format import RankTrace, TraceWriter, build_event_batch, build_rank_meta, trace_file_name

MS = 1_000_000
T0 = 1_000_000_000
ITERATIONS = 6


def _trace(rank: int, coords: dict, layout: dict, rows: list[dict], clock: str = "monotonic") -> RankTrace:
    meta = build_rank_meta(
        rank=rank, world_size=len(rows), coords=coords, layout=layout, host="h", device="cpu", run_id="t", clock=clock
    )
    return RankTrace(meta, pa.Table.from_batches([build_event_batch(rows)]), path=f"rank{rank}")


def _dp_job(
    forward: dict[int, tuple[float, float]], delay: dict[int, tuple[float, float]] | None = None, n=4, clock="monotonic"
):
    """DP replicas: per iteration a forward of (wall, cpu) ms, an all-reduce the last arrival starts
    and 2 ms of transfer after it, then 1 ms of Python. delay: rank -> (run delay, throttled) ms."""
    delay = delay or {}
    layout = {"tp_size": 1, "pp_size": 1, "dp_size": n, "virtual_pp_size": 1}
    rows: dict[int, list[dict]] = {r: [] for r in range(n)}
    for it in range(ITERATIONS):
        t = T0 + it * 200 * MS
        jitter = (it % 3) * 0.2  # the same on every rank: paired comparison cancels it
        last = max(forward.get(r, (10, 10))[0] for r in range(n)) + jitter
        for r in range(n):
            wall, cpu = forward.get(r, (10.0, 10.0))
            wall += jitter
            run_delay, throttled = delay.get(r, (0.0, 0.0))
            end = t + int((last + 3) * MS)
            rows[r] += [
                dict(name="iteration", cat="step", start_ns=t, end_ns=end, iteration=it, cpu_ns=int((cpu + 1) * MS),
                     run_delay_ns=int(run_delay * MS), throttled_ns=int(throttled * MS), involuntary_switches=1,
                     nr_throttled=1 if throttled else 0),
                dict(name="forward", cat="compute", start_ns=t, end_ns=t + int(wall * MS), iteration=it,
                     cpu_ns=int(cpu * MS)),
                dict(name="all_reduce", cat="comm", op="all_reduce", group="dp", seq=it, bytes=4096, iteration=it,
                     start_ns=t + int(wall * MS), end_ns=t + int((last + 2) * MS)),
            ]  # fmt: skip
    return [_trace(r, {"tp": 0, "dp": r, "pp": 0}, layout, rows[r], clock) for r in range(n)]


def _by_rank(traces):
    return {r.rank: r for r in compute_budget_summary(traces, tuple(range(ITERATIONS))).ranks}


def test_a_waiting_replicas_budget_is_the_time_it_spent_where():
    rows = compute_budget(_dp_job({2: (20.0, 20.0)}), tuple(range(ITERATIONS))).rows
    fast = next(r for r in rows if r.rank == 0 and r.iteration == 0)
    slow = next(r for r in rows if r.rank == 2 and r.iteration == 0)
    # The fast replica computed 10 ms, waited 10 ms for rank 2, transferred 2 ms, ran Python 1 ms.
    assert (fast.wall_ns, fast.own_ns, fast.waiting_ns, fast.transfer_ns, fast.rest_ns) == (
        23 * MS, 10 * MS, 10 * MS, 2 * MS, 1 * MS,
    )  # fmt: skip
    assert (slow.own_ns, slow.waiting_ns, slow.transfer_ns, slow.rest_ns) == (20 * MS, 0, 2 * MS, 1 * MS)


def test_on_a_device_clock_own_work_is_the_compute_spans_device_time():
    # Kernels were launched in a few microseconds of host CPU; the spans' times are the device's.
    job = _dp_job(dict.fromkeys(range(4), (10.0, 0.01)) | {2: (20.0, 0.01)}, clock="cuda")
    rows = compute_budget(job, tuple(range(ITERATIONS))).rows
    fast = next(r for r in rows if r.rank == 0 and r.iteration == 0)
    assert (fast.own_ns, fast.waiting_ns, fast.transfer_ns, fast.rest_ns) == (10 * MS, 10 * MS, 2 * MS, 1 * MS)
    assert _by_rank(job)[2].cause == "own work"


def _random_pipeline(seed: int, clock: str) -> list[RankTrace]:
    """PP2 x DP2 with random compute, random overlaps, messages both ways, random (or unknown) signals."""
    rng = random.Random(seed)
    layout = {"tp_size": 1, "pp_size": 2, "dp_size": 2, "virtual_pp_size": 1}
    rows: dict[int, list[dict]] = {r: [] for r in range(4)}
    for it in range(ITERATIONS):
        t = T0 + it * 500 * MS
        for dp in range(2):
            src, dst = dp, dp + 2
            f0, x, f1 = (int(rng.uniform(1, 20) * MS) for _ in range(3))
            send, recv_end = t + f0, t + f0 + x
            rows[src] += [
                dict(name="forward", cat="compute", start_ns=t, end_ns=send, iteration=it, cpu_ns=rng.choice([-1, f0 // 2])),
                dict(name="send", cat="comm", op="send", peer=dst, seq=it, bytes=65536, iteration=it, start_ns=send,
                     end_ns=send + MS),
                dict(name="recv", cat="comm", op="recv", peer=dst, seq=it, bytes=65536, iteration=it,
                     start_ns=send + MS, end_ns=recv_end + f1 + 2 * MS),
            ]  # fmt: skip
            rows[dst] += [
                dict(name="recv", cat="comm", op="recv", peer=src, seq=it, bytes=65536, iteration=it,
                     start_ns=t + rng.randrange(0, f0), end_ns=recv_end),
                dict(name="forward", cat="compute", start_ns=recv_end, end_ns=recv_end + f1, iteration=it,
                     cpu_ns=rng.choice([-1, f1])),
                dict(name="send", cat="comm", op="send", peer=src, seq=it, bytes=65536, iteration=it,
                     start_ns=recv_end + f1, end_ns=recv_end + f1 + MS),
                dict(name="all_reduce", cat="comm", op="all_reduce", group="x", seq=it, iteration=it,
                     start_ns=recv_end, end_ns=recv_end + f1 + 3 * MS),
            ]  # fmt: skip
        end = t + 400 * MS
        for r in range(4):
            signals = [rng.choice([-1, rng.randrange(0, 300 * MS)]) for _ in range(3)]
            rows[r].append(
                dict(name="iteration", cat="step", start_ns=t, end_ns=end, iteration=it, cpu_ns=signals[0],
                     run_delay_ns=signals[1], throttled_ns=signals[2])
            )  # fmt: skip
    return [_trace(r, {"tp": 0, "dp": r % 2, "pp": r // 2}, layout, rows[r], clock) for r in range(4)]


@pytest.mark.parametrize("clock", ["monotonic", "cuda"])
def test_every_rank_and_iterations_budget_adds_up_to_its_wall_time(clock):
    for seed in range(5):
        rows = compute_budget(_random_pipeline(seed, clock), tuple(range(ITERATIONS))).rows
        assert len(rows) == 4 * ITERATIONS
        for r in rows:
            parts = (r.own_ns, r.descheduled_ns, r.waiting_ns, r.transfer_ns, r.rest_ns)
            assert min(parts) >= 0 and 0 <= r.throttled_ns <= r.descheduled_ns, r
            assert abs(sum(parts) - r.wall_ns) <= 1, r
        assert any(r.waiting_ns > 0 for r in rows) and any(r.transfer_ns > 0 for r in rows)
        assert any(r.descheduled_ns > 0 for r in rows) and any(not r.measured for r in rows)


def test_a_rank_whose_compute_takes_cpu_time_is_slow_by_its_own_work():
    ranks = _by_rank(_dp_job({2: (20.0, 20.0)}))
    assert ranks[2].slow and ranks[2].cause == "own work" and ranks[2].self_ratio > 1.8
    assert not any(ranks[r].slow for r in (0, 1, 3))
    assert ranks[0].median_ns["waiting"] == 10 * MS  # its peers wait for it


def test_a_rank_whose_run_delay_explains_its_slowness_is_descheduled_not_own_work():
    # Rank 2's forward takes 20 ms of wall time but 10 ms of CPU: 10 ms it was runnable, not running
    # (8 of them throttled by a CPU quota).
    ranks = _by_rank(_dp_job({2: (20.0, 10.0)}, {2: (10.0, 8.0)}))
    assert ranks[2].slow and ranks[2].cause == "descheduled", ranks[2]
    assert ranks[2].median_ns["descheduled"] == 10 * MS and ranks[2].median_ns["throttled"] == 8 * MS
    assert ranks[2].median_ns["own"] == ranks[0].median_ns["own"] == 10 * MS
    # Without the counters the same spans leave 10 ms unexplained: outside the spans, not descheduled.
    ranks = _by_rank(_dp_job({2: (20.0, 10.0)}))
    assert ranks[2].slow and ranks[2].cause == "outside the spans"


def test_the_throttled_time_counts_where_the_run_delay_is_unknown():
    ranks = _by_rank(_dp_job({2: (20.0, 10.0)}, {2: (-1.0, 10.0)}))
    assert ranks[2].cause == "descheduled" and ranks[2].median_ns["throttled"] == 10 * MS


def test_cpu_time_and_delay_that_explain_a_slow_rank_equally_are_named_both():
    ranks = _by_rank(_dp_job({2: (30.0, 20.0)}, {2: (10.0, 0.0)}))
    assert ranks[2].cause == "own work and descheduled"


def test_budget_thresholds_a_user_cannot_mean_are_refused():
    with pytest.raises(ValueError, match="slow_ratio must be above 1"):
        BudgetConfig(slow_ratio=1.0)
    with pytest.raises(ValueError, match=r"descheduled_margin must be in \[0, 1\]"):
        BudgetConfig(descheduled_margin=1.5)


def _pipeline_links(
    transfer_ms: dict[tuple, float], descheduled: set[int], dp: int = 3, gradients_ms: float | None = None
) -> list[RankTrace]:
    """PP2 x DP`dp`: stage-0 rank d sends 64 KiB to stage-1 rank d + dp after 5 ms of forward; the
    receiver has been waiting since the iteration began. With gradients_ms, the stage-1 rank sends
    64 KiB back after its forward, taking that long. Ranks in `descheduled` were runnable but not
    running for half of every iteration."""
    layout = {"tp_size": 1, "pp_size": 2, "dp_size": dp, "virtual_pp_size": 1}
    rows: dict[int, list[dict]] = {r: [] for r in range(2 * dp)}
    for it in range(ITERATIONS):
        t = T0 + it * 100 * MS
        for d in range(dp):
            src, dst = d, d + dp
            x = int(transfer_ms.get((src, dst), 1.0) * MS)
            send = t + 5 * MS
            rows[src] += [
                dict(name="forward", cat="compute", start_ns=t, end_ns=send, iteration=it, cpu_ns=5 * MS),
                dict(name="send", cat="comm", op="send", peer=dst, seq=it, bytes=65536, iteration=it, start_ns=send,
                     end_ns=send + 100_000),
            ]  # fmt: skip
            rows[dst] += [
                dict(name="recv", cat="comm", op="recv", peer=src, seq=it, bytes=65536, iteration=it, start_ns=t,
                     end_ns=send + x),
                dict(name="forward", cat="compute", start_ns=send + x, end_ns=send + x + 5 * MS, iteration=it,
                     cpu_ns=5 * MS),
            ]  # fmt: skip
            if gradients_ms is not None:
                back = send + x + 5 * MS
                rows[dst].append(
                    dict(
                        name="send",
                        cat="comm",
                        op="send",
                        peer=src,
                        seq=it,
                        bytes=65536,
                        iteration=it,
                        start_ns=back,
                        end_ns=back + 100_000,
                    )
                )
                rows[src].append(dict(name="recv", cat="comm", op="recv", peer=dst, seq=it, bytes=65536, iteration=it,
                                      start_ns=send + 200_000, end_ns=back + int(gradients_ms * MS)))  # fmt: skip
        for r in range(2 * dp):
            delay = 25 * MS if r in descheduled else 0
            rows[r].append(
                dict(name="iteration", cat="step", start_ns=t, end_ns=t + 50 * MS, iteration=it, cpu_ns=10 * MS,
                     run_delay_ns=delay, throttled_ns=0)
            )  # fmt: skip
    return [_trace(r, {"tp": 0, "dp": r % dp, "pp": r // dp}, layout, rows[r]) for r in range(2 * dp)]


def test_a_link_is_compared_only_over_messages_whose_ends_were_not_descheduled():
    # 0 -> 3 is rate-limited (8 ms per 64 KiB); 2 -> 5 takes as long because its receiver is
    # descheduled half of the time and wakes late from every receive.
    traces = _pipeline_links({(0, 3): 8.0, (2, 5): 8.0}, descheduled={5})
    links = {(x.src, x.dst): x for x in compute_budget_summary(traces, tuple(range(ITERATIONS))).links}
    assert links[(0, 3)].ratio > 6 and links[(0, 3)].comparable_links == 1  # against 1 -> 4 only
    assert links[(0, 3)].ns_per_byte == pytest.approx(8 * MS / 65536)
    assert links[(2, 5)].clean_messages == 0 and links[(2, 5)].ratio is None
    assert links[(1, 4)].ratio < 0.5
    assert [link for link, x in links.items() if x.slow] == [(0, 3)]


def _cli(argv: list[str]) -> int:
    return main(["trace", *argv])


def _write(trace_dir, traces):
    trace_dir.mkdir(parents=True, exist_ok=True)
    for t in traces:
        with TraceWriter(trace_dir / trace_file_name(t.rank), t.meta) as w:
            w.append(t.events.to_batches()[0])


def test_detect_budget_and_the_report_show_the_time_budget(tmp_path, capsys):
    _write(tmp_path / "t", _dp_job({2: (20.0, 10.0)}, {2: (10.0, 8.0)}))
    _cli(["detect", str(tmp_path / "t"), "--budget"])
    out = capsys.readouterr().out
    assert "Time budget per rank" in out and "rank 2: slow" in out and "descheduled" in out
    _cli(["detect", str(tmp_path / "t"), "--budget", "--json"])
    doc = json.loads(capsys.readouterr().out)
    rank2 = doc["budget"]["ranks"][2]
    assert rank2["cause"] == "descheduled" and rank2["median_ms"]["throttled"] == 8.0
    _cli(["detect", str(tmp_path / "t"), "--json"])
    assert "budget" not in json.loads(capsys.readouterr().out)
    assert _cli(["report", str(tmp_path / "t"), "--out", str(tmp_path / "r.html")]) == 0
    page = (tmp_path / "r.html").read_text()
    assert "<h2>Time budget</h2>" in page and "descheduled" in page and "<td>8.00</td>" in page


def test_links_are_compared_with_links_of_their_own_pipeline_direction():
    # Gradients (upstream) take 8 ms per message on both links, activations 1 ms: no link is slow.
    traces = _pipeline_links({}, set(), dp=2, gradients_ms=8.0)
    links = {(x.src, x.dst): x for x in compute_budget_summary(traces, tuple(range(ITERATIONS))).links}
    assert sorted(links) == [(0, 2), (1, 3), (2, 0), (3, 1)]
    assert all(x.ratio == pytest.approx(1.0) and not x.slow for x in links.values()), links
