"""The flags every launching command shares (`train`, `generate`, `scope capture|serve`,
`trace run`): how many local ranks, on which device, the model's layout over them, the tokenizer.
Defined once here; each command's parser takes the ones it needs (megatronapp/flags.py)."""

from __future__ import annotations

from megatronapp.flags import Flag

NPROC_PER_NODE = Flag(
    "--nproc-per-node",
    None,
    "launch N local processes through torch.distributed.run (omit under torchrun)",
    {"type": int, "metavar": "N"},
)
DEVICE = Flag("--device", None, "default: cuda when present", {"choices": ("cpu", "cuda")})
# ParallelLayout's fields (their defaults are the flags')
LAYOUT_FLAGS = (
    Flag("--tensor-model-parallel-size", "tp_size", "TP: ranks sharing each layer", {"type": int}),
    Flag("--pipeline-model-parallel-size", "pp_size", "PP: pipeline stages", {"type": int}),
)
VIRTUAL_STAGES = Flag(
    "--num-virtual-stages-per-pipeline-rank",
    None,
    "interleaved pipeline: model chunks per pipeline rank (default: 1)",
    {"type": int},
)
TOKENIZER_MODEL = Flag("--tokenizer-model", None, "Hugging Face tokenizer.json; default: bytes")
