import sys
import warnings
from pathlib import Path

import pytest
import torch

# tests/<package>/ hold the tests, tests/dist/ the gloo process harness and the job bodies it runs,
# tests/support/ the other helpers. Every folder goes on sys.path here, before any worker is
# spawned: a spawned rank imports a job body by module name (some live beside their tests,
# e.g. test_checkpoint.train_save_resume), and module names are unique across folders.
for _folder in sorted(p for p in Path(__file__).parent.iterdir() if p.is_dir() and any(p.glob("*.py"))):
    sys.path.insert(0, str(_folder))

from dist_harness import ProcessCluster  # noqa: E402


@pytest.fixture(scope="session")
def cluster():
    """One pool of gloo worker processes for the whole session (spawning torch processes is
    the slowest part of a small distributed test); each job still gets a fresh process group."""
    c = ProcessCluster(max_world=8, timeout=300)
    yield c
    c.close()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; run on the GPU machine (see README)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> str:
    """inference_jobs.save_tiny_checkpoint's folder, written once per test run; read-only to tests."""
    from inference_jobs import save_tiny_checkpoint

    path = tmp_path_factory.mktemp("tiny_ckpt")
    torch.set_num_threads(1)
    save_tiny_checkpoint(str(path))
    return str(path)


@pytest.fixture(scope="session")
def ui_checkpoint(tmp_path_factory) -> str:
    """scope_ui_jobs.save_ui_checkpoint's folder, written once per test run; read-only to tests."""
    from scope_ui_jobs import save_ui_checkpoint

    path = tmp_path_factory.mktemp("ui_ckpt")
    torch.set_num_threads(1)
    save_ui_checkpoint(str(path))
    return str(path)


@pytest.fixture
def train_before_launch(monkeypatch, capsys):
    """`megatronapp train --device cpu --model tiny ARGS` in this process, with every way of
    starting ranks (local launch, the in-process worker) replaced by a test failure: returns
    (exit code, non-empty stderr lines). So a refused input is proven refused before launch."""
    from megatronapp.cli.main import main

    def launched(*args, **kwargs):
        raise AssertionError("ranks were started for input that should have been refused")

    monkeypatch.setattr("megatronapp.cli.launch.run_ranks_for_result", launched)
    monkeypatch.setattr("megatronapp.cli.train.run_rank", launched)

    def run(args: list[str]) -> tuple[int, list[str]]:
        try:
            with warnings.catch_warnings():  # main's @record wants a real stderr for faulthandler
                warnings.filterwarnings("ignore", "Unable to enable fault handler")
                code = main(["train", "--device", "cpu", "--model", "tiny", *args])
        except SystemExit as exc:  # argparse's usage errors
            code = exc.code
        return code, [line for line in capsys.readouterr().err.splitlines() if line]

    return run
