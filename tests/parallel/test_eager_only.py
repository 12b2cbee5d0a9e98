"""eager_only against torch.compiler.disable, under TorchDynamo as installed."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import torch

from megatronapp.parallel.eager_only import eager_only, prepare_compile


def _compiled(mark) -> tuple[int, int, int, bool]:
    """Graphs, captured calls and graph breaks of compiling a function that calls a marked one
    between two ops, and whether the marked function ran inside a compiled frame."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    seen = []

    def body(x):
        seen.append(torch.compiler.is_compiling())
        return torch.sin(x) * 2 + 1

    marked = mark(body)

    def outer(x):
        return marked(torch.cos(x)) - 1

    prepare_compile()
    compiled = torch.compile(outer, backend="eager")
    x = torch.arange(4.0)
    for _ in range(2):
        assert torch.equal(compiled(x), outer(x))
    stats = counters["stats"]
    return stats["unique_graphs"], stats["calls_captured"], sum(counters["graph_break"].values()), any(seen)


def test_compiled_graphs_around_an_eager_only_function_are_those_around_a_disabled_one():
    reference = _compiled(torch.compiler.disable)
    assert reference == (2, 2, 1, False)  # two graphs around one break; the marked function ran eagerly
    assert _compiled(eager_only) == reference
    assert _compiled(lambda fn: fn) != reference  # unmarked, it is compiled into one graph


# TorchDynamo keeps a frame's skip mark for the life of the process, so the frames traced
# without prepare_compile are looked at first, in a process of their own.
_TRACED_FRAMES = textwrap.dedent(
    """
    import json, torch
    from torch._dynamo.eval_frame import dynamo_tls
    from megatronapp.parallel.eager_only import eager_only, prepare_compile

    marked = eager_only(lambda x: torch.sin(x))

    def outer(x):
        return marked(torch.cos(x)) - 1

    traced = {}
    for prepared in (False, True):
        torch._dynamo.reset()
        dynamo_tls.traced_frame_infos.clear()
        if prepared:
            prepare_compile()
        torch.compile(outer, backend="eager")(torch.ones(3))
        traced[prepared] = [info.split()[0] for info in dynamo_tls.traced_frame_infos]
    print(json.dumps(traced))
    """
)


def test_after_prepare_compile_the_wrappers_own_frame_is_not_traced():
    res = subprocess.run([sys.executable, "-c", _TRACED_FRAMES], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    traced = json.loads(res.stdout)
    assert "call" in traced["false"] and traced["true"] == ["outer"], traced


def test_a_command_or_a_rank_does_not_import_torchdynamo():
    code = (
        "import sys, megatronapp.cli.main, megatronapp.engine.trainer, megatronapp.model.gpt; "
        "print('torch._dynamo' in sys.modules)"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "False", res.stderr[-2000:]
