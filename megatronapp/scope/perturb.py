"""Applying perturbation specs: activation faults through forward hooks, parameter faults in
place (restored bit for bit on removal). See specs.py for the spec format.

    with scope.perturb(model, spec):          # model: InferenceModel, GPTChunk(s)
        generate(...)  /  trainer.train_step()

Layout independence: every random field is drawn at the *full* tensor's shape (all TP
shards, every batch row and column of the step) from a generator keyed by (seed, site,
layer, step) or (seed, parameter), then sliced to this rank's shard. Parameter faults wrap a
forward/backward or a whole training step: on removal the hit elements get their original
bits back (an optimizer update of those few elements is discarded), the rest is kept.
"""

from __future__ import annotations

import zlib

import torch

from megatronapp.scope.bits import apply_bit_op, format_of, masks_for_bits, random_bit_masks
from megatronapp.scope.sites import layer_modules
from megatronapp.scope.specs import Perturbation, validate_perturbation
from megatronapp.scope.target import ScopeTarget, resolve_target


def keyed_generator(seed: int, *keys) -> torch.Generator:
    """CPU generator seeded from the spec seed and global indices (never from rank state)."""
    mixed = zlib.crc32(repr((int(seed), *keys)).encode())
    return torch.Generator().manual_seed(mixed * 1_000_003 + int(seed))


def _local(full: torch.Tensor, shard: tuple[int, int, int] | None) -> torch.Tensor:
    if shard is None:
        return full
    dim, size, rank = shard
    return full.chunk(size, dim=dim)[rank]


def corrupt(x: torch.Tensor, spec: Perturbation, selected: torch.Tensor, shard, gen: torch.Generator) -> torch.Tensor:
    """New local tensor: `spec` applied to the elements of x selected (full-shape bool mask
    `selected`, sliced by `shard` = (dim, tp_size, tp_rank) or None)."""
    return corrupt_with_mask(x, spec, selected, shard, gen)[0]


def corrupt_with_mask(
    x: torch.Tensor, spec: Perturbation, selected: torch.Tensor, shard, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """(corrupted local tensor, local bool mask of the elements hit); see `corrupt`."""
    full_shape = tuple(selected.shape)
    hit = selected
    if spec.rate is not None:  # drawn first, so the same elements are hit whatever the kind
        hit = hit & (torch.rand(full_shape, generator=gen) < spec.rate)
    hit = _local(hit, shard).to(x.device)
    draw = lambda fn: _local(fn(full_shape, generator=gen), shard).to(device=x.device, dtype=x.dtype)
    if spec.kind == "gaussian":
        noise = draw(torch.randn) * spec.sigma
        new = x + (noise * x.abs() if spec.relative else noise)
    elif spec.kind == "uniform":
        new = x * (spec.low + (spec.high - spec.low) * draw(torch.rand))
    elif spec.kind == "offset":
        new = x + spec.value
    elif spec.kind == "special":
        new = torch.full_like(x, float(spec.value))
    else:
        fmt = format_of(spec.format, x.dtype)
        if spec.bits is not None:
            masks = masks_for_bits(fmt, list(spec.bits))
        else:
            masks = _local(random_bit_masks(fmt, fmt.field_bits(spec.field), spec.num_bits, full_shape, gen), shard)
        op = "flip" if spec.kind == "bitflip" else f"stuck{spec.stuck}"
        new = apply_bit_op(x, fmt, hit, masks, op)
    return torch.where(hit, new, x), hit


def _index_mask(length: int, chosen) -> torch.Tensor:
    mask = torch.zeros(length, dtype=torch.bool)
    mask[list(chosen)] = True
    return mask


def activation_selection(spec: Perturbation, positions: torch.Tensor, full_shape: tuple[int, ...]) -> torch.Tensor:
    """Full-shape bool mask of the targeted elements; shape (B, S, [heads,] width)."""
    t = spec.target
    sel = torch.ones(full_shape, dtype=torch.bool)
    extra = len(full_shape) - 2
    if t.positions is not None:
        pos = torch.isin(positions.cpu(), torch.tensor(t.positions))
        sel &= pos.reshape(*pos.shape, *([1] * extra))
    if t.heads is not None:
        sel &= _index_mask(full_shape[2], t.heads).reshape(1, 1, -1, 1)
    if t.channels is not None:
        sel &= _index_mask(full_shape[-1], t.channels)
    return sel


class Perturber:
    """An installed perturbation; `remove()` (or leaving the with-block) undoes it exactly."""

    def __init__(self, target: ScopeTarget, spec: Perturbation):
        self.target, self.spec = target, spec
        self.handles, self.saved = [], {}
        if spec.target.site == "param":
            self._apply_param_fault()
        else:
            self._install_hooks()

    def __enter__(self) -> Perturber:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []
        with torch.no_grad():  # only the hit elements: a training step's update elsewhere is kept
            for p, hit, original in self.saved.values():
                p.copy_(torch.where(hit, original, p))
        self.saved = {}

    # -- parameters --------------------------------------------------------------------
    def _apply_param_fault(self) -> None:
        t, name = self.spec.target, self.spec.target.param
        p = self.target.named_params().get(name)
        if p is None:
            return  # another pipeline stage holds it
        full_shape = self.target.local_full_shapes()[name]
        numel = 1
        for n in full_shape:
            numel *= n
        sel = (_index_mask(numel, t.indices) if t.indices is not None else torch.ones(numel, dtype=torch.bool)).reshape(
            full_shape
        )
        shard = None if p.tp_split_dim is None else (p.tp_split_dim, self.target.tp_size, self.target.tp_rank)
        gen = keyed_generator(self.spec.seed, "param", name)
        with torch.no_grad():
            new, hit = corrupt_with_mask(p.detach(), self.spec, sel, shard, gen)
            self.saved[name] = (p, hit, p.detach().clone())
            p.copy_(new)

    # -- activations -------------------------------------------------------------------
    def _install_hooks(self) -> None:
        site = self.spec.target.site
        layers = self.spec.target.layers
        for layer, block in self.target.blocks().items():
            if layers is not None and layer not in layers:
                continue
            mods = layer_modules(block)
            if site in ("q", "k", "v"):
                hook = self._qkv_hook(layer, "qkv".index(site))
                self.handles.append(mods["qkv"].register_forward_hook(hook, prepend=True))
            elif site == "fc1":
                self.handles.append(mods["fc2"].register_forward_pre_hook(self._fc1_hook(layer), prepend=True))
            else:
                module = {"attn_out": mods["attn"], "mlp_out": mods["mlp"], "residual": mods["block"]}[site]
                self.handles.append(module.register_forward_hook(self._output_hook(layer), prepend=True))

    def _active(self) -> bool:
        steps = self.spec.target.steps
        return steps is None or self.target.step() in steps

    def _apply(self, x: torch.Tensor, layer: int, full_shape, shard) -> torch.Tensor:
        b, s = x.shape[:2]
        positions = self.target.positions(b, s, x.device)
        sel = activation_selection(self.spec, positions, full_shape)
        gen = keyed_generator(self.spec.seed, self.spec.target.site, layer, self.target.step())
        return corrupt(x, self.spec, sel, shard, gen)

    def _tp_shard(self, dim: int):
        return None if self.target.tp_size == 1 else (dim, self.target.tp_size, self.target.tp_rank)

    def _output_hook(self, layer: int):
        def hook(module, args, output):
            if not self._active():
                return None
            return self._apply(output, layer, tuple(output.shape), None)

        return hook

    def _fc1_hook(self, layer: int):
        def hook(module, args):
            if not self._active():
                return None
            x = args[0]
            full = (*x.shape[:2], x.shape[2] * self.target.tp_size)
            return (self._apply(x, layer, full, self._tp_shard(2)),)

        return hook

    def _qkv_hook(self, layer: int, which: int):
        def hook(module, args, output):
            if not self._active():
                return None
            b, s, _ = output.shape
            cfg = self.target.cfg
            d, per_group = cfg.head_dim, cfg.num_attention_heads // cfg.query_groups
            out = output.view(b, s, -1, per_group + 2, d).clone()  # (B, S, local groups, [q.. | k | v], D)
            # q: the query heads (group-major); k, v: one head per query group
            rows = slice(0, per_group) if which == 0 else slice(per_group + which - 1, per_group + which)
            part = out[:, :, :, rows].reshape(b, s, -1, d)  # (B, S, local heads or groups, D)
            full = (b, s, part.shape[2] * self.target.tp_size, d)
            out[:, :, :, rows] = self._apply(part, layer, full, self._tp_shard(2)).view(
                b, s, -1, rows.stop - rows.start, d
            )
            return out.view(b, s, -1)

        return hook


def perturb(model, spec: Perturbation | dict | str) -> Perturber:
    """Validate `spec` (a Perturbation, its dict or JSON) and install it on `model`.

    Raises PerturbSpecError in one line before touching the model when the spec cannot apply.
    """
    if isinstance(spec, str):
        spec = Perturbation.from_json(spec)
    elif isinstance(spec, dict):
        from megatronapp.scope.specs import perturbation_from_dict

        spec = perturbation_from_dict(spec)
    target = resolve_target(model)
    dtype = next(target.chunks[0].parameters()).dtype
    validate_perturbation(spec, target.cfg, target.full_param_shapes(), dtype)
    return Perturber(target, spec)
