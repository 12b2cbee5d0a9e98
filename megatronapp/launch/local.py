"""Run one command on N local ranks through torch.distributed.run (standalone torchrun).

Every rank runs exactly what `torchrun --standalone --nproc-per-node N -m MODULE ARGS` would
run. A command that launches itself (`megatronapp train --nproc-per-node 2 ...`) hands its own
argv, minus that flag, to its ranks (`rank_argv`); a rank knows it is one by the variables
torchrun sets (`under_launcher`). If any rank raises, the elastic agent stops the others and we
print, in one line, the rank whose failure caused the end (failures.pick_root_failure).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import uuid
from collections.abc import Sequence
from pathlib import Path

from megatronapp.flags import Flag
from megatronapp.launch.failures import pick_root_failure

NPROC_FLAG = "--nproc-per-node"
# Hidden: where rank 0 of a relaunched command writes its result (JSON) for the launching process
RESULT_FILE = Flag("--result-file", "result_file", "rank 0 writes its result here (JSON)")


def under_launcher() -> bool:
    """True inside a rank started by torchrun (it sets WORLD_SIZE and RANK)."""
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def launched_world_size(nproc_per_node: int | None) -> int:
    """The world a command runs on: torchrun's (inside a rank), else its --nproc-per-node (1 if unset)."""
    return int(os.environ["WORLD_SIZE"]) if under_launcher() else (nproc_per_node or 1)


def rank_argv(argv: Sequence[str], extra: Sequence[str] = ()) -> list[str]:
    """The launching command's argv for its ranks: without `--nproc-per-node N`, plus `extra`."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == NPROC_FLAG:
            skip = True
        elif not arg.startswith(NPROC_FLAG + "="):
            out.append(arg)
    return out + list(extra)


def torchrun_argv(module: str, args: Sequence[str], nproc: int) -> list[str]:
    """torch.distributed.run's command line for `nproc` local ranks of `python -m module args`."""
    return ["--standalone", NPROC_FLAG, str(nproc), "--monitor-interval", "0.1", "--module", module, *args]


def torchrun_command(module_args: Sequence[str], nproc: int) -> list[str]:
    """The command line of `nproc` local ranks of `python -m MODULE ARGS` (module_args = [MODULE, *ARGS])
    under torch.distributed.run."""
    return [sys.executable, "-m", "torch.distributed.run", *torchrun_argv(module_args[0], module_args[1:], nproc)]


def trace_run_command(nproc: int, trace_dir: str | Path, script_argv: Sequence[str], flags=()) -> list[str]:
    """The command line of `megatronapp trace run` of SCRIPT ARGS (`script_argv`) on `nproc` ranks."""
    head = [sys.executable, "-m", "megatronapp.cli.main", "trace", "run", NPROC_FLAG, str(nproc)]
    return [*head, "--trace-dir", str(trace_dir), *flags, "--", *script_argv]


def remove_stale_rank_traces(trace_dir: str | Path) -> None:
    """Create `trace_dir` and remove rank files of an earlier run there, so that a smaller
    world does not merge an older run's extra ranks."""
    d = Path(trace_dir)
    d.mkdir(parents=True, exist_ok=True)
    for stale in d.glob("rank*.mscan"):
        stale.unlink()


def run_local_ranks(module: str, args: Sequence[str], nproc: int, prog: str = "megatronapp") -> int:
    """Run `python -m module args` on `nproc` local ranks; 0 when all succeed, else 1 after
    printing '<prog>: rank R failed (exit code C): MESSAGE' for the rank that caused it.

    Defaults the ranks inherit (each kept if already set): OMP threads sharing the machine's
    cores, torchrun's own logging quiet, one run id for all ranks' traces."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    if nproc < 1:
        raise ValueError(f"{NPROC_FLAG} must be >= 1, got {nproc}")
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    os.environ.setdefault("LOGLEVEL", "ERROR")
    os.environ.setdefault("MEGATRONAPP_RUN_ID", uuid.uuid4().hex[:12])
    try:
        run(get_args_parser().parse_args(torchrun_argv(module, args, nproc)))
    except ChildFailedError as exc:
        rank, failure, message = pick_root_failure(exc.failures)
        print(f"{prog}: rank {rank} failed (exit code {failure.exitcode}): {message}", file=sys.stderr)
        return 1
    return 0


def run_ranks_for_result(argv: Sequence[str], nproc: int) -> tuple[int, dict | None]:
    """Run this `megatronapp` command (`argv`) on `nproc` local ranks, rank 0 writing its result
    to a --result-file; (exit code, that result or None when the ranks failed or wrote none)."""
    result = Path(tempfile.mkdtemp(prefix="megatronapp-")) / "result.json"
    code = run_local_ranks("megatronapp.cli.main", rank_argv(argv, [RESULT_FILE.option, str(result)]), nproc)
    return code, json.loads(result.read_text()) if code == 0 and result.is_file() else None
