import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # dist_harness, engine_jobs


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; run on the GPU machine (see README)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
