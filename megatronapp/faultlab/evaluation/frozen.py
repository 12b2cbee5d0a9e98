"""Frozen evaluation of MegaScan detection on real faults from the fault lab (megatronapp/faultlab).

A split is only worth quoting if the detector was fixed before its scenarios existed, so:

    # 0. every detector threshold in one file (DetectConfig's fields; edit it to tune on design splits)
    python benchmarks/scan_eval.py frozen thresholds --out out/frozen/thresholds.json
    # 1. freeze: record the detector version (git commit + sha256 of the thresholds file), *then*
    #    draw the split's seed and scenarios; written once to SPLIT/split.json
    python benchmarks/scan_eval.py frozen freeze out/frozen/design1 --thresholds out/frozen/thresholds.json \
        --runs-per-kind 3 --clean-runs 3          # --kind-runs two_faults=10: fewer of one fault kind
    # 2. run it, once (refused if the detector changed since freezing, or if it already ran)
    python benchmarks/scan_eval.py frozen run out/frozen/design1
    # 3. score: per fault kind and per layout, n and 95% Wilson intervals, both hashes in the report
    python benchmarks/scan_eval.py frozen score out/frozen/design1

Re-scoring a split with another detector (commit or thresholds) is refused: a changed detector
gets a new split. The working tree must be clean when freezing (else the commit does not say
what ran). Tune on design splits only; a held-out split is frozen after tuning and quoted as is.

Scenarios (all real faults): none and noise (a busy loop per core) as clean runs; slow_rank (a
cgroup quota or a competing pinned process, 2.5-6x below the rank's fair share of CPU, on any rank);
intermittent (the same for 300 ms of every 2 s... 1 s, on a job of 300 iterations); user_straggler (extra matmuls in one
rank's step of the DDP or FSDP2 example under `trace run`, 0.3-2x the step: STEP_IN_MATMULS); slow_link (a PP engine job with each
rank in its own namespace, one pipeline link in either direction rate-limited to 100, 200 or 500
Mbit/s); two_faults (a slow rank and a slow link). Layouts: engine TP/PP/DP mixes of 4 ranks and
TP2 PP2 DP2, and the DDP/FSDP2 examples at dp 2 and 4. One run is one lab job (~15-45 s on an idle
2-core machine), run one at a time; `run --resume` continues a split cut short (a part per sitting).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
import secrets
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]  # the repository: examples/ and tests/ live there

KINDS = ("none", "noise", "slow_rank", "intermittent", "user_straggler", "slow_link", "two_faults")
CLEAN_KINDS = ("none", "noise")
ENGINE_LAYOUTS = ((1, 2, 2), (2, 1, 2), (2, 2, 1), (1, 4, 1), (1, 1, 4), (2, 2, 2))  # (tp, pp, dp)
LINK_RATES_MBIT = (100, 200, 500)  # a degraded link, not a dead one: 4-40x below veth's rate with its ~32 KiB messages
SCRIPT_LAYOUTS = (("ddp", 2), ("ddp", 4), ("fsdp2", 2), ("fsdp2", 4))
SCRIPTS = {
    "ddp": ("examples/ddp_train.py", ("--steps", "16", "--hidden", "768", "--batch", "96")),
    "fsdp2": ("examples/fsdp2_train.py", ("--steps", "16", "--hidden", "256", "--batch", "64")),
}
# A straggler's extra work is drawn as a factor of the traced step it slows, 0.3-2x (a step 1.3-3x as long,
# the constant slow rank's range), and converted to the scripts' extra matmuls with the step's length in
# them, measured under `trace run` on the 2-core CI machine: DDP 18.6 / 51 ms at dp 2 / 4 and 0.47 / 0.57 ms
# an extra matmul; FSDP2 52 / 126 ms and 0.095 / 0.104 ms (4 processes share 2 cores: an extra matmul costs
# more wall time than alone, and FSDP2's step is mostly communication, so the same MACs matter far less).
STRAGGLER_FACTOR = (0.3, 2.0)
STEP_IN_MATMULS = {("ddp", 2): 40, ("ddp", 4): 90, ("fsdp2", 2): 550, ("fsdp2", 4): 1200}
SHORT_ITERATIONS, LONG_ITERATIONS = 20, 300  # engine jobs (engine_iterations)


class FrozenSplitError(ValueError):
    """A split that may not be run or scored as asked; the message says why."""


# -- detector version ------------------------------------------------------------------------


def threshold_fields() -> dict:
    """Every plain threshold of DetectConfig with its default (rules and ranges excluded)."""
    from megatronapp.scan.analyze.detect_config import DetectConfig

    return {
        f.name: f.default
        for f in dataclasses.fields(DetectConfig)
        if isinstance(f.default, (int, float)) and not isinstance(f.default, bool)
    }


def load_thresholds(path: Path) -> dict:
    """The thresholds file: a JSON object of DetectConfig fields, every one present."""
    values = json.loads(Path(path).read_text())
    expected = threshold_fields()
    missing, unknown = sorted(set(expected) - set(values)), sorted(set(values) - set(expected))
    if missing or unknown:
        raise FrozenSplitError(
            f"{path}: thresholds file must hold every detector threshold (missing {missing}, unknown {unknown})"
        )
    return values


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()


def code_version() -> dict:
    """{commit, dirty}: the detector's code as checked out."""
    return {"commit": _git("rev-parse", "HEAD"), "dirty": bool(_git("status", "--porcelain", "--untracked-files=no"))}


def detector_version(thresholds_path: Path) -> dict:
    """{commit, thresholds_sha256, dirty}: what decides every verdict of a split."""
    load_thresholds(thresholds_path)
    return {**code_version(), "thresholds_sha256": hashlib.sha256(Path(thresholds_path).read_bytes()).hexdigest()}


def _same_detector(recorded: dict, current: dict) -> str | None:
    """None if the same; else what differs, in words."""
    diffs = [
        f"{k} {recorded.get(k)} -> {current.get(k)}"
        for k in ("commit", "thresholds_sha256")
        if recorded.get(k) != current.get(k)
    ]
    return "; ".join(diffs) if diffs else None


# -- scenarios -------------------------------------------------------------------------------


def engine_iterations(rng: random.Random, kind: str) -> int:
    """Training iterations of an engine scenario. An intermittent fault (300 ms of every 1-2 s) must
    overlap training many times: LONG_ITERATIONS of the CPU engine's ~50-150 ms take 15-45 s,
    whereas SHORT_ITERATIONS (~1-3 s) may fall between two bursts (design split 4, a 9% quota
    for 300 ms of every 1.5 s on DP4: p = 1 over 120 iterations, 3 bursts; p = 3e-7 over 300).
    Clean runs are drawn at both lengths, so false alarms are measured where each rule has the
    most iterations to err on."""
    if kind == "intermittent":
        return LONG_ITERATIONS
    return rng.choice((SHORT_ITERATIONS, LONG_ITERATIONS)) if kind in CLEAN_KINDS else SHORT_ITERATIONS


def extra_matmuls(rng: random.Random, script: str, dp: int) -> int:
    """A user-code straggler's extra matmuls per step: STRAGGLER_FACTOR of its step."""
    return max(1, round(rng.uniform(*STRAGGLER_FACTOR) * STEP_IN_MATMULS[(script, dp)]))


def draw_scenario(rng: random.Random, index: int, kind: str) -> dict:
    """One scenario as JSON-ready data: kind, layout, the faults and the true causes."""
    if kind == "user_straggler":
        script, dp = rng.choice(SCRIPT_LAYOUTS)
        rank = rng.randrange(dp)
        return {
            "index": index,
            "kind": kind,
            "layout": f"{script} dp{dp}",
            "job": {"script": script, "nproc": dp},
            "faults": [{"type": "extra_work", "rank": rank, "matmuls": extra_matmuls(rng, script, dp)}],
            "truth": [["slow_compute", rank]],
        }
    pp_needed = kind in ("slow_link", "two_faults")
    layouts = [lay for lay in ENGINE_LAYOUTS if lay[1] > 1] if pp_needed else ENGINE_LAYOUTS
    tp, pp, dp = rng.choice(layouts)
    iters = engine_iterations(rng, kind)
    sc = {
        "index": index,
        "kind": kind,
        "layout": f"engine TP{tp} PP{pp} DP{dp}",
        "job": {"tp": tp, "pp": pp, "dp": dp, "iters": iters},
        "faults": [],
        "truth": [],
        "nodes": 0,
    }
    if kind == "noise":
        sc["faults"].append({"type": "noise"})
    world = tp * pp * dp
    if kind in ("slow_rank", "intermittent", "two_faults"):
        rank = rng.randrange(world)
        fault = {
            "type": "slow_rank",
            "rank": rank,
            "method": rng.choice(["quota", "compete"]),
            "factor": round(rng.uniform(2.5, 6.0), 2),
        }
        if kind == "intermittent":
            fault["schedule"] = [300, rng.choice([1000, 1500, 2000])]
        sc["faults"].append(fault)
        sc["truth"].append(["slow_compute", rank])
    if pp_needed:
        src, stage = rng.randrange(world), tp * dp  # global rank = tp + dp * TP + pp * TP * DP
        forward = src // stage < pp - 1 if src // stage in (0, pp - 1) else rng.random() < 0.5
        dst = src + stage if forward else src - stage  # a pipeline neighbour, either direction
        sc["faults"].append({"type": "slow_link", "src": src, "dst": dst, "rate_mbit": rng.choice(LINK_RATES_MBIT)})
        sc["truth"].append(["slow_link", [src, dst]])
        sc["nodes"] = world
    return sc


def plan_split(seed: int, runs_per_kind: int, clean_runs: int, kind_runs: dict | None = None) -> list[dict]:
    """Scenarios of a split: clean_runs split between none and noise, runs_per_kind of each fault kind
    (kind_runs: other counts for some fault kinds, e.g. fewer of the slow two_faults)."""
    unknown = sorted(set(kind_runs or {}) - (set(KINDS) - set(CLEAN_KINDS)))
    if unknown or any(n < 0 for n in (kind_runs or {}).values()):
        raise FrozenSplitError(
            f"kind_runs takes fault kinds {sorted(set(KINDS) - set(CLEAN_KINDS))} and counts >= 0, got {kind_runs}"
        )
    rng, out = random.Random(seed), []
    counts = {
        "none": clean_runs - clean_runs // 2,
        "noise": clean_runs // 2,
        **{k: runs_per_kind for k in KINDS if k not in CLEAN_KINDS},
        **(kind_runs or {}),
    }
    for kind in KINDS:
        for _ in range(counts[kind]):
            out.append(draw_scenario(rng, len(out), kind))
    rng.shuffle(out)  # kinds interleaved: a machine that gets busier later does not hit one kind only
    return out


def freeze_split(
    split_dir: Path,
    thresholds_path: Path,
    runs_per_kind: int,
    clean_runs: int,
    allow_dirty: bool = False,
    kind_runs: dict | None = None,
) -> dict:
    """Record the detector version, then draw a fresh seed and the scenarios; write split.json once."""
    split_dir = Path(split_dir)
    if (split_dir / "split.json").exists():
        raise FrozenSplitError(f"{split_dir} is already frozen: a new split needs a new directory")
    version = detector_version(thresholds_path)  # before the seed exists: the detector cannot see the split
    if version["dirty"] and not allow_dirty:
        raise FrozenSplitError("the working tree has uncommitted changes: commit the detector before freezing")
    thresholds = load_thresholds(thresholds_path)
    seed = secrets.randbits(62)
    split = {
        "detector": version,
        "thresholds": thresholds,
        "thresholds_file": str(Path(thresholds_path).resolve()),
        "seed": seed,
        "frozen_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "scenarios": plan_split(seed, runs_per_kind, clean_runs, kind_runs),
    }
    split_dir.mkdir(parents=True, exist_ok=True)
    _write_json_once(split_dir / "split.json", split)
    return split


def _write_json_once(path: Path, payload: dict) -> None:
    from megatronapp.files import write_text_atomic

    write_text_atomic(path, json.dumps(payload, indent=2) + "\n")


def load_split(split_dir: Path, thresholds_path: Path | None = None) -> dict:
    """split.json, refused unless the current detector is the one it was frozen with."""
    split = json.loads((Path(split_dir) / "split.json").read_text())
    current = detector_version(Path(thresholds_path or split["thresholds_file"]))
    diff = _same_detector(split["detector"], current)
    if diff:
        raise FrozenSplitError(
            f"{split_dir} was frozen with another detector ({diff}): "
            "a changed detector gets a new split, it never re-scores an old one"
        )
    return split


def write_default_thresholds(path: Path) -> None:
    """A thresholds file holding every detector threshold at its default."""
    if Path(path).exists():
        raise FrozenSplitError(f"{path} exists: edit it, or write the defaults elsewhere")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    _write_json_once(Path(path), threshold_fields())
