"""The link probe at the end of a traced job, over the job's own process group.

After the last iteration every rank calls `probe_traced_job`; whether it measures is decided by
the trace's probe mode, the same on every rank (`should_probe`): "on", or "auto" when the job
sent point-to-point messages (a pipeline), whose links a trace can only infer. The probe runs
in a group of its own with a timeout, so a stuck rank costs at most that long; rank 0 writes
TRACE_DIR/probe.json (probe_config.py), with the measurements or with why there are none.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from megatronapp.parallel.layout import ParallelLayout
from megatronapp.scan.probe import compute_probe_pairs, measure_links
from megatronapp.scan.probe_config import PROBE_FILE, PROBE_MODES, ProbeConfig, save_probe


def should_probe(mode: str, has_p2p: bool) -> bool:
    """Probe at the end of a traced job? `mode` one of PROBE_MODES; `has_p2p`: the job sent
    point-to-point messages (must be the same on every rank)."""
    if mode not in PROBE_MODES:
        raise ValueError(f"trace probe mode must be one of {PROBE_MODES}, got {mode!r}")
    return mode == "on" or (mode == "auto" and has_p2p)


def probe_traced_job(
    trace_dir: str | Path,
    pairs: list[tuple[int, int, str]],
    rank: int,
    device: torch.device,
    config: ProbeConfig = ProbeConfig(),
) -> str:
    """Measure every directed link of `pairs` (probe.compute_probe_pairs of the job's layout) in a
    group of all ranks with the probe's timeout (collective over the world); rank 0 writes
    probe.json. Returns "" when measured, else why not (written to probe.json too): a probe that
    fails never fails the job it follows."""
    try:
        group = dist.new_group(timeout=timedelta(seconds=config.timeout_s))
        links = measure_links(
            pairs,
            rank,
            payload_bytes=config.payload_bytes,
            repeats=config.repeats,
            device=device,
            group=group,
        )
        dist.destroy_process_group(group)
    except (RuntimeError, ValueError) as exc:  # a rank gone, a timeout
        why = f"the link probe could not run: {' '.join(str(exc).split())[:300]}"
        if rank == 0:
            save_probe(Path(trace_dir) / PROBE_FILE, [], why)
        return why
    if rank == 0:
        save_probe(
            Path(trace_dir) / PROBE_FILE,
            [m.as_dict() for m in links],
            payload_bytes=config.payload_bytes,
            repeats=config.repeats,
        )
    return ""


def probe_program_links(
    trace_dir: str | Path, mode: str, sent_pairs: set[tuple[int, int]], rank: int, world: int, device: torch.device
) -> str:
    """The probe at the end of a program traced by `trace run`, whose layout MegaScan does not know:
    the links its point-to-point messages used (`sent_pairs`, this rank's (src, dst) pairs; every
    rank's are gathered first, over the default group), both ways, and a ring over all ranks (the
    path of its collectives). Collective; returns what probe_traced_job returns, or "skipped"."""
    if mode == "off" or world < 2:
        return "skipped"
    everyone: list = [None] * world
    dist.all_gather_object(everyone, sorted(sent_pairs))
    used = {(a, b) for part in everyone for a, b in part if a != b and a >= 0 and b >= 0}
    if not should_probe(mode, bool(used)):
        return "skipped"
    pairs = {pair: "pipeline" for a, b in used for pair in ((a, b), (b, a))}
    for a, b, kind in compute_probe_pairs(ParallelLayout(world)):
        pairs.setdefault((a, b), kind)
    return probe_traced_job(trace_dir, sorted((a, b, k) for (a, b), k in pairs.items()), rank, device)
