"""Generation on CUDA: the CUDA-graph decode replays the eager computation."""

from __future__ import annotations

import pytest
import torch

from megatronapp.config import model_preset
from megatronapp.inference.generate import SamplingConfig, generate
from megatronapp.inference.model import build_inference_model
from megatronapp.parallel.groups import single_process_groups

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graph_decode_equals_eager(dtype):
    cfg = model_preset("demo", vocab_size=257)
    model = build_inference_model(cfg, single_process_groups(), "cuda", seed=5, dtype=dtype)
    prompts = [[5, 6, 7, 8, 9], [1, 2, 3]]
    sampling = SamplingConfig(max_new_tokens=24, stop_on_eod=False)
    start = model.start
    model.start = lambda b, n, pad: start(b, n, pad, static=True)  # same computation, not replayed
    eager = generate(model, prompts, sampling, eod_id=256, vocab_size=257)
    model.start = start
    model.cuda_graphs = True
    graphed = generate(model, prompts, sampling, eod_id=256, vocab_size=257)
    assert model._graph is not None and model.cache.static
    assert graphed.tokens == eager.tokens
