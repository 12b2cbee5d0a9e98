"""--deterministic (Megatron's --deterministic-mode): the settings under which two runs of the
same job give bit-identical losses and gradients.

  * torch.use_deterministic_algorithms(True), not warn-only: ops without a deterministic
    kernel raise, and SDPA's flash and memory-efficient backwards run their deterministic
    variants (the efficient one without split keys); cuDNN's convolution autotuning is off;
  * CUBLAS_WORKSPACE_CONFIG=:4096:8 (cuBLAS reductions in a fixed order; read when the first
    handle is made, so it is set before any CUDA work);
  * NCCL_ALGO=Ring unless one of Megatron's accepted algorithms is set: for one communicator
    and message size NCCL then reduces in one fixed order (read at communicator creation);
  * NVTE_ALLOW_NONDETERMINISTIC_ALGO=0 for Transformer Engine kernels, as Megatron sets;
  * attention: "auto" becomes "flash" (its deterministic backward); cuDNN attention has no
    deterministic backward and is refused.

The engine's own reductions already have a fixed order: each gradient bucket is all-reduced
as one message whatever order the buckets become ready in, the grad norm sums per-tensor norms
in parameter order, and the loss all-reduce is one message. The cost is measured in
BENCHMARKS.md.
"""

from __future__ import annotations

import torch

from megatronapp.config import ConfigError

NCCL_DETERMINISTIC_ALGOS = ("Tree", "Ring", "CollnetDirect", "CollnetChain", "^NVLS")  # Megatron's list
CUBLAS_DETERMINISTIC_WORKSPACES = (":4096:8", ":16:8")
DETERMINISTIC_ATTENTION = {"auto": "flash", "flash": "flash", "efficient": "efficient", "math": "math"}


def compute_deterministic_env(environ) -> dict[str, str]:
    """The environment variables to set (those not already set to an accepted value)."""
    wanted = {}
    if environ.get("CUBLAS_WORKSPACE_CONFIG") not in CUBLAS_DETERMINISTIC_WORKSPACES:
        wanted["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    if environ.get("NCCL_ALGO") not in NCCL_DETERMINISTIC_ALGOS:
        wanted["NCCL_ALGO"] = "Ring"
    if environ.get("NVTE_ALLOW_NONDETERMINISTIC_ALGO") != "0":
        wanted["NVTE_ALLOW_NONDETERMINISTIC_ALGO"] = "0"
    return wanted


def deterministic_attention_backend(requested: str) -> str:
    """The --attention-backend to run under --deterministic; ConfigError for cuDNN's."""
    if requested not in DETERMINISTIC_ATTENTION:
        raise ConfigError(
            f"--deterministic needs an attention backend with a deterministic backward "
            f"({', '.join(sorted(set(DETERMINISTIC_ATTENTION.values())))}), not {requested}"
        )
    return DETERMINISTIC_ATTENTION[requested]


def enable_deterministic_mode(environ) -> None:
    """Process-wide, by the entry point, before any CUDA work or process group: the
    environment (`environ`, normally os.environ) and torch's switches."""
    environ.update(compute_deterministic_env(environ))
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


def check_deterministic_mode() -> None:
    """For the trainer: a job asking for --deterministic in a process not set up for it."""
    if not torch.are_deterministic_algorithms_enabled() or torch.is_deterministic_algorithms_warn_only_enabled():
        raise ConfigError(
            "--deterministic: call megatronapp.engine.determinism.enable_deterministic_mode "
            "before building the trainer (the CLI does)"
        )
