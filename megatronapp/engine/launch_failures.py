"""Which rank's failure caused a torchrun job's end (every launcher in the package names it).

When one rank dies, its peers fail too (their collectives lose the connection) and torchrun stops
the rest; ChildFailedError lists them all. Naming the first by time alone names a victim as often
as not: error files carry whole-second timestamps.
"""

from __future__ import annotations

import signal

# What a rank reports when it fails only because a peer died (gloo / NCCL wording).
_PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "remote worker crashing",
              "communicator was aborted", "ncclRemoteError")


def pick_root_failure(failures: dict) -> tuple[int, object, str]:
    """(rank, failure, message) of the failure that caused the others: error files carry
    whole-second timestamps, so ties are broken by preferring a rank that is not a victim, then
    the earliest, then the lowest rank. Victims: a rank whose error is 'a peer went away', and a
    rank the launcher stopped with SIGTERM after the first failure (it writes no error file, so
    its timestamp is when the launcher collected it, often the crash's own second)."""
    def message(f) -> str:  # a dict with the traceback when the rank recorded its error
        m = f.message
        return str(m.get("message", m)) if isinstance(m, dict) else str(m)

    def key(item):
        rank, f = item
        victim = f.exitcode == -signal.SIGTERM or any(s in message(f) for s in _PEER_LOST)
        return (victim, f.timestamp, rank)

    rank, failure = min(failures.items(), key=key)
    return rank, failure, message(failure)
