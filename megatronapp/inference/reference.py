"""One-call greedy generation from a checkpoint in this process, for comparisons with other
implementations (e.g. `transformers` on the Hugging Face export of the same checkpoint).

    tokens = greedy_generate_from_checkpoint("ckpt", [[72, 105]], max_new_tokens=16, eod_id=256, vocab_size=257)

Differences a comparison must allow for: ids >= vocab_size (vocabulary padding) are never
chosen here, and a row stops at `eod_id` (pass stop_on_eod=False to compare raw argmax runs).
"""

from __future__ import annotations

import torch

from megatronapp.inference.generate import SamplingConfig, generate
from megatronapp.inference.model import build_inference_model, read_model_config
from megatronapp.parallel.groups import single_process_groups


def greedy_generate_from_checkpoint(
    load_dir,
    prompts: list[list[int]],
    max_new_tokens: int,
    *,
    eod_id: int,
    vocab_size: int,
    device="cpu",
    dtype: torch.dtype = torch.float32,
    stop_on_eod: bool = True,
) -> list[list[int]]:
    """Greedy new tokens per prompt from the latest checkpoint in `load_dir` (one process)."""
    model = build_inference_model(
        read_model_config(load_dir), single_process_groups(), device, load_dir=load_dir, dtype=dtype
    )
    cfg = SamplingConfig(max_new_tokens=max_new_tokens, stop_on_eod=stop_on_eod)
    return generate(model, prompts, cfg, eod_id=eod_id, vocab_size=vocab_size).tokens
