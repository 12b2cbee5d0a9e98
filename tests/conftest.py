import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # dist_harness, engine_jobs

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
