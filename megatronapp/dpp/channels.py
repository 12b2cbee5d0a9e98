"""Which process group carries each kind of message of the dynamic runtime.

On CPU every message rides the default gloo group: a message's header and payload (tags
HEADER_TAG / PAYLOAD_TAG, transport.py), and TP rank 0's decisions ride the engine's TP group.

On CUDA that layout would deadlock or stall, for two reasons, so the runtime builds
*separate channels* (`build_channels(..., separate=True)`):

* **A group per directed pair for payloads.** NCCL runs all point-to-point work between two
  ranks of one communicator on one stream, in the order it was posted, and a send's kernel
  does not finish before the matching receive runs. The dynamic runtime posts receives
  ahead (transport.PeerReceiver); NCCL's guide says sends and receives that must progress
  together have to be posted in one group call, which posting ahead cannot do. So on a
  shared communicator rank A's receive of a gradient from B, posted early, would sit in
  front of A's later send of the activation that B needs to produce that gradient: both
  streams wait for ever. With one two-rank group
  per direction (A -> B and B -> A apart), a communicator carries one direction only: one
  rank only sends on it and the other only receives, both in FIFO order, so a send waits
  only for its own receive, which the receiver posts regardless of what either rank
  computes. That is also why the runtime's sends and receives can be issued from different
  threads: each communicator is used by one thread per rank (NCCL communicators are not
  thread-safe).
* **Host data on gloo.** Headers (a message's identity) and decisions (3 int64s) are read
  by the host before it decides; on NCCL reading them would wait for the GPU (and NCCL moves
  no CPU tensors). Headers go over a gloo group of the whole job, decisions over a gloo copy
  of the TP group.

Every rank must build the channels, in the same order (torch.distributed.new_group is
collective over the world); `Channels.destroy` removes the groups it made.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist

from megatronapp.dpp.tasks import remote_inputs
from megatronapp.parallel.groups import ParallelGroups
from megatronapp.parallel.layout import ParallelLayout


def compute_message_pairs(layout: ParallelLayout, num_chunks: int) -> list[tuple[int, int]]:
    """Every directed (source, destination) pair of global ranks that exchanges pipeline
    messages in a step, sorted: each pipeline's stage p receives from the ranks that produce
    its remote inputs (p - 1 and p + 1, and the wrap-around between the last and first
    stage when chunks are interleaved)."""
    pairs = set()
    for ranks in layout.pp_group_ranks():
        for p, dst in enumerate(ranks):
            for _, src in remote_inputs(p, layout.pp_size, num_chunks, 1):
                pairs.add((ranks[src], dst))
    return sorted(pairs)


@dataclass
class Channels:
    """The groups this rank's messages use; None (or a missing pair) means the default group."""

    decision_group: object  # TP rank 0's decisions
    header_group: object = None
    payload_groups: dict = field(default_factory=dict)  # (src, dst) -> group with this rank in it
    owned: list = field(default_factory=list)  # groups built here, destroyed by destroy()

    def payload_group(self, src: int, dst: int):
        return self.payload_groups.get((src, dst))

    def destroy(self) -> None:
        if dist.is_initialized():
            for group in self.owned:
                dist.destroy_process_group(group)
        self.owned.clear()
        self.payload_groups.clear()


def build_channels(groups: ParallelGroups, num_chunks: int, *, separate: bool, payload_backend: str) -> Channels:
    """This rank's channels (collective over the world when `separate`: every rank calls it).
    One process has nothing to send, and may run without torch.distributed: no groups."""
    if not separate or groups.layout.world_size == 1:
        return Channels(decision_group=groups.tp)
    me, world = groups.rank, groups.layout.world_size
    header_group = dist.new_group(list(range(world)), backend="gloo")
    channels = Channels(decision_group=None, header_group=header_group, owned=[header_group])
    for pair in compute_message_pairs(groups.layout, num_chunks):
        group = dist.new_group(list(pair), backend=payload_backend)
        if me in pair:
            channels.payload_groups[pair] = group
            channels.owned.append(group)
    for ranks in groups.layout.tp_group_ranks():
        if len(ranks) > 1:
            group = dist.new_group(ranks, backend="gloo")
            if me in ranks:
                channels.decision_group = group
                channels.owned.append(group)
    return channels
