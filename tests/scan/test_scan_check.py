"""`megatronapp trace check`: Perfetto's own trace processor, run offline, on timelines with
known answers (flow direction is decided by which slice starts first, not by which end is "s")."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from megatronapp.scan.perfetto.check import check_timeline


def _x(name, pid, ts, dur):
    return dict(ph="X", name=name, pid=pid, tid=1, ts=ts, dur=dur)


def _flow(ph, pid, ts):
    return dict(ph=ph, name="p2p", cat="flow", id=7, pid=pid, tid=1, ts=ts, **({"bp": "e"} if ph == "f" else {}))


# (what, expected backward flows, events): one flow from pid 1 to pid 2, its end with "bp":"e".
CASES = [
    ("send -> recv", 0, [_x("send", 1, 10, 10), _x("recv", 2, 12, 20), _flow("s", 1, 15), _flow("f", 2, 25)]),
    (
        "flow start lands inside a recv",
        1,
        [_x("send", 1, 10, 3), _x("recv", 1, 14, 16), _x("recv", 2, 16, 20), _flow("s", 1, 15), _flow("f", 2, 25)],
    ),
    (
        "recv slice starts before its send",
        1,
        [_x("send", 1, 100, 10), _x("recv", 2, 50, 100), _flow("s", 1, 100), _flow("f", 2, 120)],
    ),
    (
        "same, flow ends in a later child slice",
        0,
        [
            _x("send", 1, 100, 10),
            _x("recv", 2, 50, 100),
            _x("recv done", 2, 105, 1),
            _flow("s", 1, 100),
            _flow("f", 2, 105.5),
        ],
    ),
]


@pytest.mark.parametrize("what,backward,events", CASES, ids=[c[0] for c in CASES])
def test_check_counts_flows_bound_backwards(tmp_path, what, backward, events):
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": events}))
    report = check_timeline(path)
    assert (report["flows"], report["backward_flows"], report["import_errors"]) == (1, backward, [])
    assert report["ok"] == (backward == 0)


def _check(*args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "megatronapp.cli.main", "trace", "check", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


def test_check_command_exits_0_clean_1_backward_2_unreadable(tmp_path):
    clean, backward, broken = tmp_path / "clean.json", tmp_path / "backward.json", tmp_path / "broken.json"
    clean.write_text(json.dumps({"traceEvents": CASES[0][2]}))
    backward.write_text(json.dumps({"traceEvents": CASES[2][2]}))
    broken.write_text('{"traceEvents": [')
    ok = _check(str(clean))
    assert ok.returncode == 0 and ok.stdout.rstrip().endswith("ok"), ok.stderr
    bad = _check(str(backward), "--json")
    assert bad.returncode == 1 and json.loads(bad.stdout)["backward_flows"] == 1
    refused = _check(str(broken))
    assert refused.returncode == 2 and "incomplete" in refused.stderr and "Traceback" not in refused.stderr
    missing = _check(str(tmp_path / "absent.json"))
    assert (
        missing.returncode == 2
        and missing.stderr == f"megatronapp: error: {tmp_path / 'absent.json'}: no such timeline file\n"
    )
    rows = _check(str(clean), "--sql", "select name from slice order by ts")
    assert rows.returncode == 0 and rows.stdout.split() == ["name", "send", "recv"]
