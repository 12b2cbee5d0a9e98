"""Perturbation specs: small, typed, seeded, JSON round-trip.

    {"kind": "bitflip", "seed": 7, "bits": [30], "format": "fp32",
     "target": {"site": "residual", "layers": [1], "positions": [3], "channels": [5], "steps": [0]}}

kinds and their parameters:

    gaussian    x + N(0, sigma), or x + N(0, sigma * |x|) with relative=true
    uniform     x * U(low, high)
    offset      x + value
    bitflip     flip `bits` (given positions) or `num_bits` random bits of `field`
    stuck_at    force `bits` / random `field` bits to `stuck` (0 or 1)
    special     set to value "nan", "inf" or "-inf"

Every kind hits the target's elements, thinned to a fraction `rate` when given (chosen by the
seeded generator). Targets: an activation site (sites.PERTURB_SITES) with layers, heads
(q/k/v), token positions, channels (last dim) and steps; or site "param" with a parameter
name and flat indices into the full (un-sharded) tensor. Randomness comes from the seed and
global indices only, so a spec corrupts the same elements the same way on any layout.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields

import torch

from megatronapp.scope.bits import format_of
from megatronapp.scope.sites import PERTURB_SITES, check_heads, check_layers

KINDS = ("gaussian", "uniform", "offset", "bitflip", "stuck_at", "special")
BIT_KINDS = ("bitflip", "stuck_at")
MAX_TARGETED_ELEMENTS = 1 << 26  # a full-tensor random field above this is refused


class PerturbSpecError(ValueError):
    """A perturbation spec that cannot apply; the message says why in one line."""


def _tuple(v):
    return None if v is None else tuple(v)


@dataclass(frozen=True)
class Target:
    site: str
    layers: tuple[int, ...] | None = None  # None: every layer
    heads: tuple[int, ...] | None = None  # q / k / v only
    positions: tuple[int, ...] | None = None  # token positions (rotary position of the token)
    channels: tuple[int, ...] | None = None  # last-dim indices (head_dim for q/k/v)
    steps: tuple[int, ...] | None = None  # generation steps (0 = prefill); None: every step
    param: str | None = None  # site "param": layout-independent parameter name
    indices: tuple[int, ...] | None = None  # site "param": flat indices into the full tensor

    def __post_init__(self) -> None:
        for name in ("layers", "heads", "positions", "channels", "steps", "indices"):
            object.__setattr__(self, name, _tuple(getattr(self, name)))


@dataclass(frozen=True)
class Perturbation:
    kind: str
    target: Target
    seed: int = 0
    rate: float | None = None  # fraction of targeted elements hit; None: all
    sigma: float = 0.0
    relative: bool = False
    low: float = 1.0
    high: float = 1.0
    value: float | str = 0.0
    format: str | None = None  # fp32 / bf16 / fp16; None: the tensor's own
    bits: tuple[int, ...] | None = None
    field: str | None = None  # sign / exponent / mantissa (random bits from it)
    num_bits: int = 1
    stuck: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.target, dict):
            object.__setattr__(self, "target", target_from_dict(self.target))
        object.__setattr__(self, "bits", _tuple(self.bits))

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Perturbation:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise PerturbSpecError(f"perturbation spec is not valid JSON: {e}") from None
        return perturbation_from_dict(data)


def _from_dict(cls, data: dict, what: str):
    if not isinstance(data, dict):
        raise PerturbSpecError(f"{what} must be a JSON object")
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise PerturbSpecError(f"unknown {what} field(s) {', '.join(unknown)}")
    try:
        return cls(**data)
    except TypeError as e:
        raise PerturbSpecError(f"bad {what}: {e}") from None


def target_from_dict(data: dict) -> Target:
    return _from_dict(Target, data, "target")


def perturbation_from_dict(data: dict) -> Perturbation:
    return _from_dict(Perturbation, data, "perturbation")


def validate_perturbation(
    spec: Perturbation, cfg, param_shapes: dict[str, tuple[int, ...]], dtype: torch.dtype = torch.float32
) -> None:
    """One-line PerturbSpecError if `spec` cannot apply to a model of `cfg` with these full
    parameter shapes, running in `dtype` (the bit format when the spec names none). Called
    before anything is installed, so a bad spec leaves the model as is."""
    try:
        _validate(spec, cfg, param_shapes, dtype)
    except ValueError as e:
        raise PerturbSpecError(str(e)) from None


def _validate(spec: Perturbation, cfg, param_shapes, dtype) -> None:
    if spec.kind not in KINDS:
        raise ValueError(f"unknown perturbation kind {spec.kind!r}; choose from {', '.join(KINDS)}")
    if spec.rate is not None and not 0 < spec.rate <= 1:
        raise ValueError(f"rate must be in (0, 1], got {spec.rate}")
    _validate_target(spec.target, cfg, param_shapes)
    if spec.kind == "gaussian" and spec.sigma <= 0:
        raise ValueError(f"gaussian noise needs sigma > 0, got {spec.sigma}")
    if spec.kind == "uniform" and not spec.low <= spec.high:
        raise ValueError(f"uniform needs low <= high, got {spec.low} > {spec.high}")
    if spec.kind == "offset" and not isinstance(spec.value, (int, float)):
        raise ValueError(f"offset value must be a number, got {spec.value!r}")
    if spec.kind == "special" and spec.value not in ("nan", "inf", "-inf"):
        raise ValueError(f"special value must be 'nan', 'inf' or '-inf', got {spec.value!r}")
    if spec.kind in BIT_KINDS:
        _validate_bits(spec, format_of(spec.format, dtype))


def _validate_bits(spec: Perturbation, fmt) -> None:
    if (spec.bits is None) == (spec.field is None):
        raise ValueError(f"{spec.kind} needs exactly one of 'bits' (given positions) or 'field' (random bits)")
    for b in spec.bits or ():
        if not 0 <= b < fmt.width:
            raise ValueError(f"bit {b} is outside the {fmt.name} format (0..{fmt.width - 1})")
    if spec.field is not None:
        candidates = fmt.field_bits(spec.field)
        if not 1 <= spec.num_bits <= len(candidates):
            raise ValueError(f"num_bits must be in 1..{len(candidates)} for field {spec.field}")
    if spec.kind == "stuck_at" and spec.stuck not in (0, 1):
        raise ValueError(f"stuck must be 0 or 1, got {spec.stuck}")


def _validate_target(t: Target, cfg, param_shapes) -> None:
    if t.site == "param":
        if t.param not in param_shapes:
            raise ValueError(f"unknown parameter {t.param!r} (e.g. {next(iter(sorted(param_shapes)))})")
        numel = 1
        for n in param_shapes[t.param]:
            numel *= n
        for i in t.indices or ():
            if not 0 <= i < numel:
                raise ValueError(f"index {i} is outside parameter {t.param} ({numel} elements)")
        if numel > MAX_TARGETED_ELEMENTS and t.indices is None:
            raise ValueError(
                f"parameter {t.param} has {numel} elements; give indices (at most "
                f"{MAX_TARGETED_ELEMENTS} elements can be targeted at a rate)"
            )
        return
    if t.site not in PERTURB_SITES:
        raise ValueError(f"unknown perturbation site {t.site!r}; choose from {', '.join(PERTURB_SITES + ('param',))}")
    check_layers(t.layers, cfg.num_layers)
    if t.heads is not None and t.site not in ("q", "k", "v"):
        raise ValueError(f"heads can only be targeted at q, k or v, not {t.site}")
    # k and v are perturbed where the model computes them: one head per query group
    check_heads(t.heads, cfg.query_groups if t.site in ("k", "v") else cfg.num_attention_heads)
    width = {"fc1": cfg.ffn_size, "q": cfg.head_dim, "k": cfg.head_dim, "v": cfg.head_dim}.get(t.site, cfg.hidden_size)
    for c in t.channels or ():
        if not 0 <= c < width:
            raise ValueError(f"channel {c} is out of range for site {t.site} (width {width})")
    for p in t.positions or ():
        if not 0 <= p < cfg.seq_length:
            raise ValueError(f"position {p} is out of range (sequence length {cfg.seq_length})")
    for s in t.steps or ():
        if s < 0:
            raise ValueError(f"step {s} must be >= 0")
