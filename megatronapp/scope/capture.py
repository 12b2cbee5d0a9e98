"""`scope.capture`: record capture sites while a model generates, gathered to rank 0.

    with scope.capture(model, sites=("q", "attn_probs", "residual", "topk"), layers=[0, 3],
                       compress="reduce:op=absmax,width=64;quantize:dtype=fp16") as cap:
        generate(model, prompts, sampling, ...)
    cap.items            # CapturedItem list on the serving rank (empty elsewhere)
    cap.save("run.safetensors")

Per step: hooks stash on device; at the step's end every rank joins `gather.collect_step`
(TP all-gather, logit lens, one packed P2P transfer per stage); the serving rank compresses
(batching.py: every per-layer site of one shape in one chain of ops) and queues ONE
asynchronous device-to-host copy of everything (a uint8 buffer into pinned memory,
staging.py). Items are built from the host copies when `items` is next read (or on exit),
so a step costs no host sync and no per-item Python. A step's token count is its batch x new
columns, host state set before the forward: a replayed graph runs no Python, so nothing the
forward assigns (e.g. cache.positions) belongs to the step.

Decode steps in one process on a static KV cache (the CUDA-graph path, InferenceModel's
"recorders") take a second route to the same items: `record_decode` runs right after the
forward, inside the decode graph, and does the whole of the above on device (logit lens as
one batched matmul, compression, packing into one buffer); after each replay `step_end` only
queues the copy of that static buffer. Configurations it cannot record (attention
probabilities reduced or top-k'd over the key dim, whose used width grows every step) keep
the hook path, and the model says so in one log line. Nothing is installed until the
with-block is entered and nothing stays after it. With GPT chunks instead of an
InferenceModel (one process, e.g. during training), call `cap.end_step()` after each forward.
"""

from __future__ import annotations

import json
from collections import deque
from dataclasses import dataclass

import torch

from megatronapp.scope.batching import compress_step, compute_top_probs
from megatronapp.scope.compress import CapturedItem, check_pipeline, parse_pipeline
from megatronapp.scope.gather import collect_step, compute_logit_lens, stage_items
from megatronapp.scope.hooks import CaptureHooks
from megatronapp.scope.sites import DEFAULT_SITES, check_heads, check_layers, check_sites, site_numel
from megatronapp.scope.staging import HostStaging, pack_blocks, view_items
from megatronapp.scope.target import resolve_target


class CaptureLimitError(ValueError):
    """A step's raw capture would pass CaptureConfig.max_bytes_per_step (nothing was captured)."""


@dataclass(frozen=True)
class CaptureConfig:
    sites: tuple[str, ...] = DEFAULT_SITES
    layers: tuple[int, ...] | None = None  # None: every layer
    heads: tuple[int, ...] | None = None  # q/k/v/attn_probs heads kept; None: all
    compress: tuple[dict, ...] = ()  # applied to per-layer sites (see compress.py)
    topk: int = 5  # next-token and logit-lens top-k
    lens_topk: int | None = None  # logit-lens top-k when it differs (the UI shows the top one)
    max_bytes_per_step: int = 1 << 30  # raw (uncompressed) capture size a step may reach


def validate_capture(model_cfg, cfg: CaptureConfig) -> tuple[tuple[int, ...], tuple[int, ...] | None, tuple]:
    """(layers, heads, compression ops) of `cfg` checked against the model; one-line ValueError."""
    check_sites(cfg.sites)
    layers = check_layers(cfg.layers, model_cfg.num_layers)
    heads = check_heads(cfg.heads, model_cfg.num_attention_heads)
    compress = check_pipeline(cfg.compress)
    if cfg.topk < 1:
        raise ValueError(f"topk must be >= 1, got {cfg.topk}")
    if cfg.lens_topk is not None and cfg.lens_topk < 1:
        raise ValueError(f"lens_topk must be >= 1, got {cfg.lens_topk}")
    return layers, heads, compress


def compute_replay_blocker(sites, compress) -> str | None:
    """Why a capture of `sites` compressed by `compress` cannot be recorded into a decode graph."""
    key_dim_ops = [op["name"] for op in compress if op["name"] in ("reduce", "topk")]
    if "attn_probs" in sites and key_dim_ops:
        return (
            f"capture of attn_probs with {key_dim_ops[0]} (it acts on the key dim, which grows "
            f"every step) runs on the hook path"
        )
    return None


def compute_raw_bytes(model_cfg, sites, num_layers: int) -> tuple[int, int]:
    """(a, b): an uncompressed fp32 step capture of `sites` at `num_layers` layers takes
    batch * new columns * (a + b * keys so far) bytes (only attention maps grow with the keys)."""
    per_layer = [site_numel(s, model_cfg, 1, 1, 1) for s in sites if s not in ("logit_lens", "topk")]
    per_key = site_numel("attn_probs", model_cfg, 1, 1, 1) if "attn_probs" in sites else 0
    return 4 * num_layers * (sum(per_layer) - per_key), 4 * num_layers * per_key


def make_capture_config(
    sites=DEFAULT_SITES,
    *,
    layers=None,
    heads=None,
    compress=(),
    topk: int = 5,
    lens_topk: int | None = None,
    max_bytes_per_step: int = 1 << 30,
) -> CaptureConfig:
    """CaptureConfig from loose arguments (`compress` may be the text form)."""
    if isinstance(compress, str):
        compress = parse_pipeline(compress)
    return CaptureConfig(
        sites=tuple(sites),
        layers=None if layers is None else tuple(layers),
        heads=None if heads is None else tuple(heads),
        compress=tuple(compress),
        topk=topk,
        lens_topk=lens_topk,
        max_bytes_per_step=max_bytes_per_step,
    )


class Capture:
    def __init__(self, model, cfg: CaptureConfig):
        self.target, self.cfg = resolve_target(model), cfg
        self.layers, self.heads, self.compress = validate_capture(self.target.cfg, cfg)
        self.want_lens = "logit_lens" in cfg.sites
        if self.target.model is None and ({"topk", "logit_lens"} & set(cfg.sites)):
            raise ValueError("topk and logit_lens need an InferenceModel (they read the logits / output layer)")
        self._items: list[CapturedItem] = []
        self._unread: deque[tuple] = deque()  # steps whose copies are queued, their items not yet built
        self.steps: list[dict] = []  # {"step", "tokens", "bytes"} of each captured step
        self.recorded_steps: list[int] = []  # steps whose items came from record_decode
        self.hooks, self.staging, self._template_bytes = None, HostStaging(), (None, 0)
        self.graph_unsupported = compute_replay_blocker(cfg.sites, self.compress)
        self._raw_bytes = compute_raw_bytes(self.target.cfg, cfg.sites, len(self.layers))
        self.decode_key = None  # set on entry when this capture can be recorded (InferenceModel)

    # -- lifecycle ---------------------------------------------------------------------
    def __enter__(self) -> Capture:
        self.hooks = CaptureHooks(self.target, self.layers, self.cfg.sites, self.want_lens)
        if self.target.model is not None:
            if self.graph_unsupported is None:
                self.decode_key = ("scope.capture", json.dumps(self._config_dict(), sort_keys=True))
            self.target.model.observers.append(self)
        return self

    @property
    def graph_hook_ids(self) -> set[int]:
        """Ids of the hooks this capture installed (all safe to replay in a decode graph)."""
        return {h.id for h in self.hooks.handles} if self.hooks is not None else set()

    def __exit__(self, *exc) -> None:
        if self.target.model is not None and self in self.target.model.observers:
            self.target.model.observers.remove(self)
        self.hooks.remove()
        self._finish_transfer()
        self.staging.guard()  # every copy has landed: release the buffers they read

    def step_begin(self, model) -> None:
        # Runs before a replayed decode step is launched, while the GPU waits: a few integer ops,
        # and the device is told to finish the last step's copy before the replay overwrites it.
        self.staging.guard()
        self.hooks.full_keys = model.recording and self.decode_key is not None
        cache = model.cache
        per_column, per_column_key = self._raw_bytes
        raw = cache.pad_left.shape[0] * cache.num_new * (per_column + per_column_key * (cache.start + cache.num_new))
        if raw > self.cfg.max_bytes_per_step:
            raise CaptureLimitError(
                f"capture would need {raw} bytes this step, over the limit of "
                f"{self.cfg.max_bytes_per_step}; capture fewer sites/layers or shorter prompts"
            )

    def step_end(self, model, logits) -> None:
        record = model.step_records.get(self.decode_key) if self.decode_key is not None else None
        cache = model.cache
        # The step's tokens from host state set before the forward: a replayed graph runs no
        # Python, so what the forward assigns (cache.positions) may be another step's.
        tokens = cache.pad_left.shape[0] * cache.num_new
        if record is not None:  # recorded on device (maybe replayed): only the copy is left
            self.hooks.stash.clear()
            buffer, template, offsets = record
            if self._template_bytes[0] is not template:
                self._template_bytes = (template, sum(it.nbytes for it in template))
            self._start_transfer(
                model.step,
                (template, offsets),
                buffer,
                tokens,
                self._template_bytes[1],
                template=True,
                key_columns=cache.start + cache.num_new,
            )
            self.recorded_steps.append(model.step)
            return
        gathered = collect_step(model, self.target, self.layers, self.cfg.sites, self.hooks.stash, self.want_lens)
        self.hooks.stash.clear()
        if gathered is None:
            return
        if "topk" in self.cfg.sites:
            gathered.append(("topk", None, "topk", self._next_token_topk(model, logits)))
        self._finish_step(model.step, gathered, tokens)

    def _next_token_topk(self, model, logits: torch.Tensor):
        return compute_top_probs(logits[:, : model.cfg.vocab_size], self.cfg.topk, log=False)

    def record_decode(self, model, out: torch.Tensor) -> tuple[torch.Tensor, list[CapturedItem], list[dict]]:
        """Device work of a static decode step in one process, right after the forward (recorded
        into the decode graph): (packed uint8 buffer, items describing its contents, their byte
        offsets in it). The same items, in the same order, as the hook path's step_end. A
        fixed number of kernels whatever the number of layers (batching.py)."""
        stash = self.hooks.stash
        gathered = stage_items(self.target, self.layers, self.cfg.sites, stash)
        if self.want_lens:  # one process: every layer's residual is here, one batched matmul
            gathered.append(("logit_lens", None, "logit_lens", compute_logit_lens(model, stash)))
        if "topk" in self.cfg.sites:
            gathered.append(("topk", None, "topk", self._next_token_topk(model, out[:, -1])))
        stash.clear()
        items, blocks = compress_step(0, gathered, self.compress, self.heads, self.cfg.topk, self.cfg.lens_topk)
        buffer, offsets = pack_blocks(blocks, items, out.device)
        return buffer, items, offsets

    def end_step(self) -> None:
        """Chunk targets (no InferenceModel): collect what the last forward stashed."""
        gathered = stage_items(self.target, self.layers, self.cfg.sites, self.hooks.stash)
        stash, self.hooks.stash = self.hooks.stash, {}
        any_t = next(iter(stash.values()), None)
        tokens = 0 if any_t is None else any_t.shape[0] * any_t.shape[-2 if any_t.dim() == 4 else 1]
        if self.target.tp_rank == 0:
            self._finish_step(len(self.steps), gathered, tokens)

    # -- serving rank: compress, one async copy --------------------------------------------
    def _finish_step(self, step: int, gathered, tokens: int) -> None:
        items, blocks = compress_step(step, gathered, self.compress, self.heads, self.cfg.topk, self.cfg.lens_topk)
        buffer, offsets = pack_blocks(blocks, items, "cpu")
        self._start_transfer(step, (items, offsets), buffer, tokens, sum(it.nbytes for it in items))

    def _start_transfer(
        self,
        step: int,
        layout,
        buffer: torch.Tensor,
        tokens: int,
        nbytes: int,
        template: bool = False,
        key_columns=None,
    ) -> None:
        """Queue the copy of this step's buffer. Its items (`layout` = (items, their offsets in the
        buffer); items are made from them for `step` when they are a `template`) are built when
        `items` is next read: per step nothing but the copy and an event, the views and Python
        objects later (at the end, or when asked)."""
        host, event = self.staging.copy(buffer)
        entry = {"step": step, "tokens": tokens, "bytes": nbytes}
        self.steps.append(entry)
        self._unread.append((host, event, layout, step if template else None, entry, key_columns))

    def _finish_transfer(self, wait: bool = True) -> None:
        """Build the items of the queued steps now, in step order: every one (waiting for their
        copies), or with wait=False those whose copies have landed, up to the first that has not."""
        while self._unread:
            host, event, (items, offsets), step, entry, key_columns = self._unread[0]
            if event is not None and not event.query():
                if not wait:
                    return
                event.synchronize()
            self._unread.popleft()
            if step is not None:
                items = _items_for_step(items, step)
            view_items(host, items, offsets)
            if key_columns is not None:  # static attention maps span the whole cache: keep the keys so far
                for it in items:
                    if it.site == "attn_probs":
                        _narrow_keys(it, key_columns)
                entry["bytes"] = sum(it.nbytes for it in items)
            self._items.extend(items)

    @property
    def items(self) -> list[CapturedItem]:
        """Every captured item so far (on the serving rank), in step order."""
        self._finish_transfer()
        return self._items

    def landed_items(self) -> list[CapturedItem]:
        """The captured items whose host copies have landed, in step order, without waiting on
        the device: a caller that has just launched the next step (its copy still queued behind
        the step's kernels) reads the earlier steps' items while the device computes."""
        self._finish_transfer(wait=False)
        return self._items

    # -- results -------------------------------------------------------------------------
    @property
    def bytes_per_token(self) -> float:
        self._finish_transfer()
        tokens = sum(s["tokens"] for s in self.steps)
        return sum(s["bytes"] for s in self.steps) / tokens if tokens else 0.0

    def get(self, site: str | None, layer: int | None = None, step: int | None = None) -> list[CapturedItem]:
        """Items of `site` (None: any site), optionally one layer and/or step."""
        return [
            it
            for it in self.items
            if (site is None or it.site == site)
            and (layer is None or it.layer == layer)
            and (step is None or it.step == step)
        ]

    def pca(self, site: str = "residual", layer: int | None = None, k: int = 2):
        """(coords (tokens, k), explained variance ratio) of `site` at `layer` over every
        token captured so far (all steps, all rows)."""
        from megatronapp.scope.pca import compute_pca, token_rows

        layer = self.layers[-1] if layer is None else layer
        return compute_pca(token_rows(self.get(site, layer)), k)

    def _config_dict(self) -> dict:
        return {
            "sites": list(self.cfg.sites),
            "layers": list(self.layers),
            "heads": None if self.heads is None else list(self.heads),
            "compress": list(self.compress),
            "topk": self.cfg.topk,
            "lens_topk": self.cfg.lens_topk or self.cfg.topk,
        }

    def manifest(self) -> dict:
        return {
            "config": self._config_dict(),
            "steps": list(self.steps),
            "bytes_per_token": self.bytes_per_token,
            "items": [it.manifest() for it in self.items],
        }


def _items_for_step(template: list[CapturedItem], step: int) -> list[CapturedItem]:
    """Fresh items of `step` with the template's layout (its tensors give shapes and dtypes)."""
    return [
        CapturedItem(
            f"step{step}/{it.name.partition('/')[2]}",
            it.site,
            step,
            it.layer,
            it.dims,
            dict(it.tensors),
            [{**op, "shape": list(op["shape"])} for op in it.ops],
        )
        for it in template
    ]


def _narrow_keys(item: CapturedItem, columns: int) -> None:
    """An attention map's key dim (last; only slice / quantize ops touched it) cut to `columns`."""
    item.tensors["data"] = item.tensors["data"][..., :columns]
    for op in item.ops:
        op["shape"][-1] = columns


def capture(model, sites=DEFAULT_SITES, **kwargs) -> Capture:
    """A capture context for `model` (InferenceModel, or GPT chunks of one process); kwargs as
    make_capture_config. Validates everything here, installs nothing until entered."""
    return Capture(model, make_capture_config(sites, **kwargs))
