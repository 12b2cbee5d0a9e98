"""Where ranks compute and which transport each group and link uses (parallel/placement.py).

Pure functions over many layouts, plus the `train` command refusing, before launch, layouts
NCCL cannot run (the GPU count is patched: these run on CPU machines).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from megatronapp.cli import main as cli_main
from megatronapp.fbd.layout import RoleLayout, compute_role_placements, role_group_ranks
from megatronapp.fbd.links import LinkDevices
from megatronapp.parallel.layout import LayoutError, ParallelLayout
from megatronapp.parallel.placement import (
    Placement,
    check_gpu_groups,
    compute_default_backend,
    compute_group_backend,
    compute_link_device_kind,
    compute_plain_placements,
    engine_group_ranks,
    resolve_device_kind,
)

GPU0, GPU1, CPU = Placement("cuda", 0), Placement("cuda", 1), Placement("cpu")


def test_backend_follows_where_members_compute():
    assert compute_group_backend([GPU0, GPU1]) == "nccl"
    assert compute_group_backend([GPU0, GPU0]) == "gloo"  # NCCL: one rank per GPU
    assert compute_group_backend([GPU0, CPU]) == "gloo"
    assert compute_group_backend([CPU, CPU]) == "gloo"
    assert compute_group_backend([GPU0, Placement("cuda", 0, node=1)]) == "nccl"  # same index, other node
    assert [compute_link_device_kind(a, b) for a, b in ((GPU0, GPU1), (GPU0, GPU0), (CPU, GPU1))] == [
        "cuda",
        "cpu",
        "cpu",
    ]
    assert compute_default_backend([CPU, CPU]) == "gloo"
    assert compute_default_backend([GPU0, CPU]) == compute_default_backend([GPU0, GPU1]) == "cpu:gloo,cuda:nccl"


def test_resolve_device_kind():
    assert resolve_device_kind(None, 0) == "cpu" and resolve_device_kind(None, 2) == "cuda"
    assert resolve_device_kind("cpu", 8) == "cpu"
    with pytest.raises(LayoutError, match="--forward-device cuda requested but no GPU is visible"):
        resolve_device_kind("cuda", 0, "--forward-device")


def _refusal(groups, placements, gpus):
    try:
        check_gpu_groups(groups, placements, gpus)
    except LayoutError as e:
        assert "\n" not in str(e)
        return str(e)
    return None


def test_plain_layouts_that_share_a_gpu_are_refused():
    one_gpu = compute_plain_placements(2, "cuda", 1)
    assert one_gpu == (GPU0, GPU0)  # torchrun's local rank, wrapped: what an oversubscribed launch does
    msg = _refusal(engine_group_ranks(ParallelLayout(2, 1, 2)), one_gpu, 1)
    assert msg.startswith("pipeline-parallel group [0, 1] would put ranks 0 and 1 on GPU 0 (1 visible)")
    assert "data-parallel group [0, 1]" in _refusal(engine_group_ranks(ParallelLayout(2)), one_gpu, 1)
    assert _refusal(engine_group_ranks(ParallelLayout(2, 1, 2)), compute_plain_placements(2, "cpu"), 0) is None
    assert _refusal(engine_group_ranks(ParallelLayout(8, 2, 2)), compute_plain_placements(8, "cuda", 8), 8) is None
    # two nodes of 4 GPUs: the same local indices on different nodes are different GPUs
    two_nodes = compute_plain_placements(8, "cuda", 4, ranks_per_node=4)
    assert _refusal(engine_group_ranks(ParallelLayout(8, 2, 2)), two_nodes, 4) is None
    msg = _refusal(engine_group_ranks(ParallelLayout(8, 2, 2)), compute_plain_placements(8, "cuda", 4), 4)
    assert msg is not None and "GPU 0" in msg


def test_one_gpu_fbd_puts_both_roles_on_it_and_hands_off_through_host_memory():
    lay = RoleLayout(2, 1, 1, 1)
    same_gpu = compute_role_placements(lay, "cuda", "cuda", 1)
    assert same_gpu == (GPU0, GPU0)
    assert _refusal(role_group_ranks(lay), same_gpu, 1) is None  # no group holds both: accepted
    assert compute_link_device_kind(*same_gpu) == "cpu"
    cpu_forward = compute_role_placements(lay, "cuda", "cpu", 1)
    assert cpu_forward == (GPU0, CPU) and compute_link_device_kind(*cpu_forward) == "cpu"
    # backward PP2 on one GPU is a plain PP2 on it: refused
    msg = _refusal(
        role_group_ranks(RoleLayout(4, 1, 2, 1)), compute_role_placements(RoleLayout(4, 1, 2, 1), "cuda", "cuda", 1), 1
    )
    assert msg.startswith("backward pipeline-parallel group [0, 1]") and msg.endswith("--device cpu")


def test_forward_workers_share_their_twins_gpu():
    lay = RoleLayout(6, 2, 2, 1)  # backward 0 1 | 2 3 (tp, pp), forward 4 (pp0) 5 (pp1)
    p = compute_role_placements(lay, "cuda", "cuda", 4)
    assert [lay.twin_of(r) for r in range(6)] == [0, 1, 2, 3, 0, 2]
    assert p[4] == p[0] and p[5] == p[2] and len(set(p[:4])) == 4
    assert compute_link_device_kind(p[5], p[2]) == "cpu"  # hand-off to the twin: host memory
    assert compute_link_device_kind(p[5], p[3]) == "cuda"  # to the other TP rank: NCCL
    assert compute_link_device_kind(p[4], p[5]) == "cuda"  # between forward stages: NCCL
    # TF > TP on GPUs: two forward TP ranks on one twin GPU -> refused, naming the forward flag
    wide = RoleLayout(6, 1, 2, 2)
    msg = _refusal(role_group_ranks(wide), compute_role_placements(wide, "cuda", "cuda", 2), 2)
    assert msg.startswith("forward tensor-parallel group [2, 3] would put ranks 2 and 3 on GPU 0")
    assert msg.endswith("--forward-device cpu")
    assert _refusal(role_group_ranks(wide), compute_role_placements(wide, "cuda", "cpu", 2), 2) is None


def test_forward_on_cuda_needs_cuda_backward_and_twin_on_its_node():
    with pytest.raises(LayoutError, match="needs --device cuda"):
        compute_role_placements(RoleLayout(2), "cpu", "cuda", 1)
    with pytest.raises(LayoutError, match="forward worker rank 2 is on node 1 but its backward twin 0 on node 0"):
        compute_role_placements(RoleLayout(4, 1, 2), "cuda", "cuda", 2, ranks_per_node=2)


@pytest.mark.parametrize(
    "tp, pp, tf, dp, gpus, fwd",
    [
        (1, 1, 1, 1, 1, "cuda"),
        (1, 2, 1, 2, 4, "cuda"),
        (2, 2, 1, 1, 4, "cuda"),
        (2, 2, 2, 2, 8, "cpu"),
        (4, 1, 2, 2, 8, "cuda"),
        (1, 4, 1, 1, 2, "cuda"),
    ],
)
def test_both_ends_of_every_link_choose_the_same_device(tp, pp, tf, dp, gpus, fwd):
    """A link's transport is picked by its tensors' device on a cpu:gloo,cuda:nccl group: a
    mismatch would pair a gloo send with an NCCL recv (a hang), so both ends must agree."""
    lay = RoleLayout((tp + tf) * pp * dp, tp, pp, tf)
    placements = compute_role_placements(lay, "cuda", fwd, gpus)
    own = [torch.device(p.kind, p.index) if p.is_cuda else torch.device("cpu") for p in placements]
    links = [LinkDevices.from_placements(placements, r, own[r]) for r in range(lay.world_size)]
    for a, b in itertools.permutations(range(lay.world_size), 2):
        kind = compute_link_device_kind(placements[a], placements[b])
        assert links[a](b).type == links[b](a).type == kind
        if placements[a] == placements[b] or not (placements[a].is_cuda and placements[b].is_cuda):
            assert kind == "cpu"


def _train(monkeypatch, capsys, gpus: int, extra: list[str]):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    rc = cli_main.main(["train", "--model", "tiny", "--device", "cuda", "--print-config", *extra])
    return rc, capsys.readouterr()


@pytest.mark.parametrize(
    "extra, message",
    [
        (
            ["--nproc-per-node", "2", "--pipeline-model-parallel-size", "2"],
            "pipeline-parallel group [0, 1] would put ranks 0 and 1 on GPU 0 (1 visible)",
        ),
        (["--nproc-per-node", "2"], "data-parallel group [0, 1] would put ranks 0 and 1 on GPU 0"),
        (
            ["--nproc-per-node", "4", "--pipeline-model-parallel-size", "2", "--forward-backward-disaggregating"],
            "backward pipeline-parallel group [0, 1] would put ranks 0 and 1 on GPU 0",
        ),
    ],
)
def test_train_refuses_two_ranks_of_a_group_on_one_gpu_before_launch(monkeypatch, capsys, extra, message):
    rc, out = _train(monkeypatch, capsys, 1, extra)
    lines = out.err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and message in lines[0], out.err


@pytest.mark.parametrize(
    "extra",
    [
        ["--nproc-per-node", "2", "--forward-backward-disaggregating"],  # backward + forward on GPU 0
        ["--nproc-per-node", "2", "--forward-backward-disaggregating", "--forward-device", "cpu"],
        ["--nproc-per-node", "1"],
    ],
)
def test_train_accepts_one_gpu_layouts(monkeypatch, capsys, extra):
    rc, out = _train(monkeypatch, capsys, 1, extra)
    assert rc == 0, out.err


def test_train_refuses_cuda_without_a_gpu(monkeypatch, capsys):
    rc, out = _train(monkeypatch, capsys, 0, ["--nproc-per-node", "1"])
    assert rc == 2 and out.err.strip() == "megatronapp: error: --device cuda requested but no GPU is visible"
