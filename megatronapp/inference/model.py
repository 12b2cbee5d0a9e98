"""A GPT loaded for inference on one rank of any TP x PP layout, and its pipelined forward.

One model replica spans every process (world = TP x PP, no data parallelism). A decoding
step runs the pipeline once: stage 0 embeds the new tokens, each stage runs its layers with
the KV cache and sends the hidden states (B, S, H) to the same-TP rank of the next stage
(torch.distributed P2P on global ranks), and the last stage turns the newest column into
logits, all-gathers the vocabulary shards over TP and sends the full (B, V) logits to the
serving rank (global rank 0), which samples.

Observers (MegaScope) are told when a step begins and ends; `step_end` runs on every rank in
the same order, so an observer may communicate there. With no observers nothing is called.

Decode steps on a static cache in one process (`recording` is then True during the step) also
run each *recorder* right after the chunk forward: an observer with `decode_key` (hashable, or
None when its current configuration cannot be replayed), `graph_hook_ids` (the forward hooks it
installed, safe to replay) and `record_decode(model, out)`, device work on what its hooks saw
in this forward, with fixed shapes and no host sync. With CUDA graphs that work is recorded
into the decode graph, and its result, refreshed by every replay, is in `step_records[key]`
when `step_end` runs. Graphs are kept per recorder keys while the static cache (one batch
size and length) lives, so a new capture configuration captures a new graph and an old one
is replayed again; an eager generation in between keeps them, a new static shape drops them.
"""

from __future__ import annotations

import json
import logging
from dataclasses import fields

import torch
import torch.distributed as dist

from megatronapp.config import ConfigError, JobConfig, ModelConfig, TrainConfig
from megatronapp.engine.checkpoint import find_latest, load_model_params
from megatronapp.inference.graphs import DecodeGraph
from megatronapp.inference.kv_cache import KVCache, compute_static_length
from megatronapp.job import validate_job
from megatronapp.model.gpt import GPTChunk, TPContext, build_model_chunks
from megatronapp.parallel.groups import ParallelGroups
from megatronapp.parallel.layout import ParallelLayout

SERVING_RANK = 0
MAX_DECODE_GRAPHS = 4  # per static cache: capture off plus a few capture configurations
log = logging.getLogger("megatronapp.inference")


def read_model_config(load_dir) -> ModelConfig:
    """The ModelConfig stored with the latest checkpoint in `load_dir`."""
    meta = json.loads((find_latest(load_dir) / "meta.json").read_text())
    known = {f.name for f in fields(ModelConfig)}
    return ModelConfig(**{k: v for k, v in meta["model"].items() if k in known})


def check_inference_layout(cfg: ModelConfig, layout: ParallelLayout) -> None:
    """One-line ConfigError when `cfg` cannot run on `layout` as one inference replica."""
    if layout.dp_size != 1 or layout.virtual_pp_size != 1:
        raise ConfigError(
            f"generation runs one model replica: world size {layout.world_size} must equal "
            f"tensor-parallel x pipeline-parallel size ({layout.tp_size} x {layout.pp_size})"
        )
    validate_job(JobConfig(model=cfg, train=TrainConfig(micro_batch_size=1, global_batch_size=1), layout=layout))


class InferenceModel:
    """This rank's chunk of the model plus what a pipelined, cached forward needs."""

    def __init__(self, cfg: ModelConfig, groups: ParallelGroups, chunk: GPTChunk, device: torch.device):
        self.cfg, self.groups, self.chunk, self.device = cfg, groups, chunk, torch.device(device)
        self.dtype = next(chunk.parameters()).dtype
        self.observers: list = []
        self.cache: KVCache | None = None
        self.step = 0  # forward steps since the last `start`
        self.cuda_graphs = False  # replay decode steps as a CUDA graph (one process on CUDA, see graphs.py)
        self._static_cache: KVCache | None = None  # the last static cache, reset and reused by shape
        self._graphs: dict = {}  # recorder keys -> DecodeGraph over _static_cache
        self._use_graph, self._graph, self._logged = False, None, set()
        self.recording = False  # this step runs the recorders (static decode step, one process)
        self.step_records: dict = {}  # recorder key -> what its record_decode returned this step
        lay = groups.layout
        self.last_stage_head_rank = lay.rank_of(0, 0, lay.pp_size - 1)

    @property
    def layers(self) -> range:
        return range(self.chunk.first_layer, self.chunk.last_layer)

    @property
    def is_serving_rank(self) -> bool:
        return self.groups.rank == SERVING_RANK

    def start(self, batch: int, max_len: int, pad_left: torch.Tensor, static: bool | None = None) -> None:
        """Fresh KV cache for a batch whose rows are left-padded by `pad_left` columns. Static
        (fixed-shape, length rounded up, reset in place when the shape repeats) when asked, or
        when CUDA graphs are asked for on one CUDA process: then even a step that cannot be
        replayed (a perturbation hook) runs eagerly on the static cache, i.e. the same kernels
        as the replay, so clean and perturbed runs differ only by the perturbation."""
        graphs = self._graphs_possible()
        static = self.cuda_graphs and self._graph_device() if static is None else static
        length = compute_static_length(max_len, self.cfg.seq_length) if static else max_len
        if static and self._static_cache is not None and self._static_cache.matches(batch, length):
            self._static_cache.reset(pad_left)
            self.cache = self._static_cache
        else:
            tp = self.groups.layout.tp_size
            self.cache = KVCache(
                self.layers,
                batch=batch,
                local_kv_heads=self.cfg.query_groups // tp,  # one key/value head per query group
                head_dim=self.cfg.head_dim,
                max_len=length,
                pad_left=pad_left,
                dtype=self.dtype,
                device=self.device,
                static=static,
            )
            if static:  # kept across eager generations, so interleaved eager runs keep the graphs
                self._static_cache, self._graphs = self.cache, {}  # old graphs read the old cache
        self.step, self._graph = 0, None
        self._use_graph = graphs

    def replay_blocker(self) -> str | None:
        """Why observers / hooks keep decode steps from being replayed (None: nothing does)."""
        safe = set()
        for obs in self.observers:
            if hasattr(obs, "decode_key") and obs.decode_key is None:
                return obs.graph_unsupported
            safe |= set(getattr(obs, "graph_hook_ids", ()))
        hooks = {i for m in self.chunk.modules() for d in (m._forward_hooks, m._forward_pre_hooks) for i in d}
        if hooks - safe:  # e.g. a perturbation: Python decides per step, a replay would skip it
            return "forward hooks that decide per step (a perturbation) are installed"
        return None

    def _graph_device(self) -> bool:
        return self.device.type == "cuda" and self.groups.layout.world_size == 1

    def _graphs_possible(self) -> bool:
        if not self.cuda_graphs:
            return False
        why = "CUDA graphs need one process on a CUDA device" if not self._graph_device() else self.replay_blocker()
        if why is not None and why not in self._logged:
            self._logged.add(why)
            log.warning("decode steps run eagerly, not as a CUDA graph: %s", why)
        return why is None

    def _recorders(self) -> list:
        return [o for o in self.observers if getattr(o, "decode_key", None) is not None]

    @torch.inference_mode()
    def forward_step(self, tokens: torch.Tensor) -> torch.Tensor | None:
        """Run new columns `tokens` (B, S) through the pipeline; full logits (B, V) of the newest
        column on the serving rank, None elsewhere. Collective over the world."""
        b, s = tokens.shape
        self.cache.begin_step(s)
        self.recording = self.cache.static and s == 1 and self.groups.layout.world_size == 1
        for obs in self.observers:
            obs.step_begin(self)
        g = self.groups
        if g.is_first_stage:
            x = tokens.to(self.device)
        else:
            x = torch.empty((b, s, self.cfg.hidden_size), dtype=self.dtype, device=self.device)
            dist.recv(x, g.pp_ranks[g.pp_rank - 1])
        if self.recording:
            out, self.step_records = self._run_decode(x)
        else:  # hidden states (B, S, H); logits (B, S, V/TP) on the last stage
            out, self.step_records = self._chunk_forward(x), {}
        logits = None
        if not g.is_last_stage:
            dist.send(out.contiguous(), g.pp_ranks[g.pp_rank + 1])
        else:
            logits = gather_last_dim(out[:, -1], g.tp, g.layout.tp_size)
        logits = self._to_serving_rank(logits, b)
        for obs in self.observers:
            obs.step_end(self, logits)
        self.step += 1
        return logits

    def _chunk_forward(self, x: torch.Tensor) -> torch.Tensor:
        self.cache.prepare()
        return self.chunk(x, cache=self.cache)

    def _run_decode(self, x: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """A static decode step and its records: replayed from the graph of the current recorder
        configuration (captured now if new), or run eagerly when graphs are off or blocked."""
        recorders = self._recorders()
        if not self._use_graph:
            return self._decode_body(x, recorders)
        key = tuple(r.decode_key for r in recorders)
        if key not in self._graphs:
            if len(self._graphs) >= MAX_DECODE_GRAPHS:  # the oldest configuration goes
                self._graphs.pop(next(iter(self._graphs)))
            self._graphs[key] = DecodeGraph(lambda t: self._decode_body(t, recorders), x.shape[0], self.device)
        self._graph = self._graphs[key]
        return self._graph.run(x)

    def _decode_body(self, x: torch.Tensor, recorders) -> tuple[torch.Tensor, dict]:
        """One static decode step and the recorders' device work (what a decode graph holds)."""
        out = self._chunk_forward(x)
        return out, {r.decode_key: r.record_decode(self, out) for r in recorders}

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits (..., V) of last-stage hidden states (..., H); collective over TP."""
        local = self.chunk.output(self.chunk.final_norm(hidden))
        return gather_last_dim(local, self.groups.tp, self.groups.layout.tp_size)

    def _to_serving_rank(self, logits: torch.Tensor | None, batch: int) -> torch.Tensor | None:
        head, me = self.last_stage_head_rank, self.groups.rank
        if head == SERVING_RANK:
            return logits if me == SERVING_RANK else None
        if me == head:
            dist.send(logits.float().contiguous(), SERVING_RANK)
        elif me == SERVING_RANK:
            logits = torch.empty((batch, self.cfg.padded_vocab_size), device=self.device)
            dist.recv(logits, head)
            return logits
        return None


def gather_last_dim(local: torch.Tensor, group, size: int) -> torch.Tensor:
    """Concatenate TP shards along the last dim (all-gather); identity without a group."""
    if group is None:
        return local
    parts = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(parts, local.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def build_inference_model(
    cfg: ModelConfig,
    groups: ParallelGroups,
    device,
    *,
    load_dir=None,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> InferenceModel:
    """This rank's chunk (weights from `load_dir`'s latest checkpoint, else initialised from
    `seed`), in eval mode (no dropout), cast to `dtype`."""
    check_inference_layout(cfg, groups.layout)
    lay = groups.layout
    tp = TPContext(groups.tp, lay.tp_size, groups.tp_rank)
    (chunk,) = build_model_chunks(
        cfg, pp_rank=groups.pp_rank, pp_size=lay.pp_size, num_chunks=1, tp=tp, seed=seed, device=device
    )
    if load_dir is not None:
        load_model_params(load_dir, [chunk], lay.tp_size, groups.tp_rank)
    for p in chunk.parameters():  # rotary tables stay fp32, as under training's autocast
        p.data = p.data.to(dtype)
    chunk.eval()
    chunk.requires_grad_(False)
    return InferenceModel(cfg, groups, chunk, device)
