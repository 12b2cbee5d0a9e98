"""MegaScope: look inside a Megatron model while it generates or trains, and change it on purpose.

    from megatronapp import scope
    with scope.capture(model, sites=("q", "attn_probs", "residual")) as cap: ...
    with scope.perturb(model, spec): ...

See sites.py for what can be captured, compress.py for compression, specs.py for
perturbations. Nothing is installed on a model unless one of these is active.
"""

from megatronapp.scope.capture import Capture, capture
from megatronapp.scope.perturb import perturb
from megatronapp.scope.specs import Perturbation, PerturbSpecError, Target

__all__ = ["Capture", "capture", "perturb", "Perturbation", "PerturbSpecError", "Target"]
