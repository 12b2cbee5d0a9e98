"""Which rank's failure caused a torchrun job's end (launch.local reports it).

When one rank dies, its peers fail too (their collectives lose the connection) and torchrun stops
the rest; ChildFailedError lists them all. Naming the first by time alone names a victim as often
as not: error files carry whole-second timestamps.
"""

from __future__ import annotations

import signal

# What a rank reports when it fails only because a peer died or stopped answering (gloo / NCCL
# wording; gloo adds "remote worker crashing" or "remote worker hanging" to its socket errors).
_PEER_LOST = (
    "Connection closed by peer",
    "Connection reset by peer",
    "remote worker crashing",
    "remote worker hanging",
    "communicator was aborted",
    "ncclRemoteError",
)


def pick_root_failure(failures: dict) -> tuple[int, object, str]:
    """(rank, failure, message) of the failure that caused the others: error files carry
    whole-second timestamps, so ties are broken by preferring a rank that is not a victim, then
    one that exited by itself rather than by a signal, then the earliest, then the lowest rank.
    Victims: a rank whose error is 'a peer went away', and a rank the launcher stopped with
    SIGTERM before it recorded any error of its own (torchrun then makes up the message, and the
    timestamp is when it collected the rank: often the crash's own second). The exit code alone
    does not decide: the crashed rank itself can be stopped by SIGTERM while it exits, after it
    recorded its error (seen in CI)."""

    def message(f) -> str:  # a dict with the traceback when the rank recorded its error
        m = f.message
        return str(m.get("message", m)) if isinstance(m, dict) else str(m)

    def key(item):
        rank, f = item
        stopped = f.exitcode == -signal.SIGTERM and message(f).startswith(f"Signal {signal.SIGTERM.value} ")
        victim = stopped or any(s in message(f) for s in _PEER_LOST)
        # Of ranks that recorded an error of their own (every rank reading the same bad input
        # does), one that exited by itself is named ahead of one the launcher then stopped.
        return (victim, f.exitcode < 0, f.timestamp, rank)

    rank, failure = min(failures.items(), key=key)
    return rank, failure, message(failure)
