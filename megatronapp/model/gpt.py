"""GPT decoder with tensor parallelism, built as pipeline chunks.

Pre-LayerNorm blocks: x + Drop(Attn(LN(x))), then x + Drop(MLP(LN(x))). Causal attention
through torch's scaled_dot_product_attention (attention dropout inside it), rotary
positions, GeLU MLP, untied input embedding and output head (Megatron's
--untie-embeddings-and-output-weights). Hidden dropout is keyed (parallel/random.py), so
its masks do not depend on the layout; sequence parallelism and recompute are options of
the same modules (parallel/layers.py, model/recompute.py).

A `GPTChunk` holds a contiguous range of layers; the chunk with layer 0 also holds the
embedding, the chunk with the last layer the final norm, output head and loss. Parameter
names use *global* layer indices ("layers.7.attn.qkv.weight"), so a checkpoint written under
one layout can be loaded under any other.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from megatronapp import spans
from megatronapp.config import ModelConfig, RecomputeConfig
from megatronapp.model.attention_kernels import specialise_on_preference
from megatronapp.model.recompute import compute_full_recompute_groups, recompute
from megatronapp.parallel.cross_entropy import vocab_parallel_cross_entropy
from megatronapp.parallel.layers import ColumnParallelLinear, LayerNorm, RowParallelLinear, VocabParallelEmbedding
from megatronapp.parallel.partition import compute_chunk_layer_ranges, compute_stage_layers
from megatronapp.parallel.random import DropoutKey, RNGStatesTracker, keyed_dropout


@dataclass(frozen=True)
class TPContext:
    group: object | None
    size: int
    rank: int
    sequence_parallel: bool = False  # activations outside TP blocks are (B, S/TP, H) shards


@dataclass(frozen=True)
class ChunkOptions:
    """How the layers of a chunk run in training (not what they compute)."""

    recompute: RecomputeConfig = field(default_factory=RecomputeConfig)
    rng_tracker: RNGStatesTracker | None = None  # attention-dropout stream (needed when it is > 0)


def rotary_tables(seq: int, head_dim: int, base: float, device) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq, device=device, dtype=torch.float32), inv_freq)  # (S, D/2)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (B, nh, S, D); rotate the two halves of each head dim (GPT-NeoX layout)
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def _norm(cfg: ModelConfig, tp: TPContext, device) -> LayerNorm:
    return LayerNorm(
        cfg.hidden_size, cfg.layernorm_epsilon, tp_group=tp.group, sequence_parallel=tp.sequence_parallel, device=device
    )


def _tp_kwargs(tp: TPContext, seed: int, device) -> dict:
    return dict(
        tp_group=tp.group,
        tp_size=tp.size,
        tp_rank=tp.rank,
        seed=seed,
        device=device,
        sequence_parallel=tp.sequence_parallel,
    )


class Attention(nn.Module):
    def __init__(self, name: str, cfg: ModelConfig, tp: TPContext, seed: int, device, options: ChunkOptions):
        super().__init__()
        h = cfg.hidden_size
        self.local_heads = cfg.num_attention_heads // tp.size
        self.head_dim = cfg.head_dim
        self.dropout_p = cfg.attention_dropout
        self.options = options
        out_std = cfg.init_method_std / math.sqrt(2.0 * cfg.num_layers)
        kw = _tp_kwargs(tp, seed, device)
        # Output rows are ordered (head, [q|k|v], head_dim) so a row slice gives whole heads.
        self.qkv = ColumnParallelLinear(f"{name}.qkv", h, 3 * h, std=cfg.init_method_std, **kw)
        self.proj = RowParallelLinear(f"{name}.proj", h, h, std=out_std, **kw)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache=None) -> torch.Tensor:
        qkv = self.qkv(x)  # (B, S, 3H/TP): sequence shards are gathered by the column-parallel linear
        b, s, _ = qkv.shape
        qkv = qkv.view(b, s, self.local_heads, 3, self.head_dim)
        q, k, v = (qkv[:, :, :, i].transpose(1, 2) for i in range(3))  # (B, nh, S, D)
        if cache is None:  # with a cache, cos/sin are already per row and column (B, 1, S, D/2)
            cos, sin = cos[:s], sin[:s]
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        specialise_on_preference()  # compiled graphs keep the kernel they were traced with
        if cache is not None:  # inference: earlier steps' keys/values and the mask (inference/kv_cache.py)
            k, v = cache.update(k, v)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=cache.attn_mask)
        elif self.options.recompute.granularity == "selective" and self.training:
            y = recompute(self._core, q, k, v, rng_tracker=self.options.rng_tracker if self.dropout_p else None)
        else:
            y = self._core(q, k, v)
        return self.proj(y.transpose(1, 2).reshape(b, s, self.local_heads * self.head_dim))

    def _core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """softmax(QK^T / sqrt(D)) V with causal mask; attention dropout on the TP-rank stream."""
        p = self.dropout_p if self.training else 0.0
        if p == 0.0:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        with self.options.rng_tracker.fork():
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p)


class MLP(nn.Module):
    def __init__(self, name: str, cfg: ModelConfig, tp: TPContext, seed: int, device):
        super().__init__()
        out_std = cfg.init_method_std / math.sqrt(2.0 * cfg.num_layers)
        kw = _tp_kwargs(tp, seed, device)
        self.fc1 = ColumnParallelLinear(f"{name}.fc1", cfg.hidden_size, cfg.ffn_size, std=cfg.init_method_std, **kw)
        self.fc2 = RowParallelLinear(f"{name}.fc2", cfg.ffn_size, cfg.hidden_size, std=out_std, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class ResidualAttention(nn.Module):
    """x + dropout(Attn(LN(x))): the unit compiled as one region (norm and residual fused in)."""

    def __init__(
        self, name: str, layer: int, cfg: ModelConfig, tp: TPContext, seed: int, device, options: ChunkOptions
    ):
        super().__init__()
        self.layer, self.dropout_p = layer, cfg.hidden_dropout
        self.norm = _norm(cfg, tp, device)
        self.attn = Attention(name, cfg, tp, seed, device, options)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dropout_key: DropoutKey | None = None, cache=None
    ) -> torch.Tensor:
        y = self.attn(self.norm(x), cos, sin, cache)
        if dropout_key is not None:  # never touch self.layer otherwise: compile would specialise per layer
            y = keyed_dropout(y, self.dropout_p, dropout_key, self.layer, "attention")
        return x + y


class ResidualMLP(nn.Module):
    """x + dropout(MLP(LN(x)))."""

    def __init__(self, name: str, layer: int, cfg: ModelConfig, tp: TPContext, seed: int, device):
        super().__init__()
        self.layer, self.dropout_p = layer, cfg.hidden_dropout
        self.norm = _norm(cfg, tp, device)
        self.mlp = MLP(name, cfg, tp, seed, device)

    def forward(self, x: torch.Tensor, dropout_key: DropoutKey | None = None) -> torch.Tensor:
        y = self.mlp(self.norm(x))
        if dropout_key is not None:
            y = keyed_dropout(y, self.dropout_p, dropout_key, self.layer, "mlp")
        return x + y


class Block(nn.Module):
    def __init__(self, layer: int, cfg: ModelConfig, tp: TPContext, seed: int, device, options: ChunkOptions):
        super().__init__()
        self.layer = layer
        self.attention = ResidualAttention(f"layers.{layer}.attn", layer, cfg, tp, seed, device, options)
        self.mlp = ResidualMLP(f"layers.{layer}.mlp", layer, cfg, tp, seed, device)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        tracer=None,
        dropout_key: DropoutKey | None = None,
        cache=None,
    ) -> torch.Tensor:
        if cache is not None:  # inference with a KV cache: this layer's view of it, no dropout
            return self.mlp(self.attention(x, cos, sin, None, cache.layer(self.layer)))
        # A key only when dropout is on: compiled regions then never see a per-step object.
        key = dropout_key if self.mlp.dropout_p else None
        if tracer is None:
            return self.mlp(self.attention(x, cos, sin, key), key)
        with tracer.layer_span(spans.ATTENTION, self.layer) as attention:
            x = self.attention(x, cos, sin, key)
        with tracer.layer_span(spans.MLP, self.layer, after=attention):
            return self.mlp(x, key)


class GPTChunk(nn.Module):
    """Layers [first_layer, last_layer) of the GPT, plus embedding / head when it owns them.

    forward(x, labels, dropout_key): x is token ids (B, S) on the chunk holding the
    embedding, else the hidden states (B, S, H) from the previous chunk ((B, S/TP, H) with
    sequence parallelism). Returns hidden states; on the chunk holding the head, per-token
    losses (B, S) when labels are given, else the logits (B, S, V/TP). `dropout_key` None
    means no hidden dropout (evaluation, generation). `cache` (inference only, see
    megatronapp.inference.kv_cache) supplies per-row positions, the attention mask and each
    layer's key/value store; without it the computation is unchanged.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        first_layer: int,
        last_layer: int,
        tp: TPContext,
        seed: int,
        device="cpu",
        options: ChunkOptions | None = None,
    ):
        super().__init__()
        self.cfg, self.tp = cfg, tp
        self.options = options or ChunkOptions()
        self.first_layer, self.last_layer = first_layer, last_layer
        self.has_embedding = first_layer == 0
        self.has_head = last_layer == cfg.num_layers
        kw = _tp_kwargs(tp, seed, device)
        if self.has_embedding:
            self.embedding = VocabParallelEmbedding(
                "embedding", cfg.padded_vocab_size, cfg.hidden_size, std=cfg.init_method_std, **kw
            )
        self.layers = nn.ModuleDict(
            {str(i): Block(i, cfg, tp, seed, device, self.options) for i in range(first_layer, last_layer)}
        )
        if self.has_head:
            self.final_norm = _norm(cfg, tp, device)
            self.output = ColumnParallelLinear(
                "output", cfg.hidden_size, cfg.padded_vocab_size, std=cfg.init_method_std, bias=False, **kw
            )
        cos, sin = rotary_tables(cfg.seq_length, cfg.head_dim, cfg.rotary_base, device)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.tracer = None  # set by the engine when per-layer spans are wanted

    def forward(
        self, x: torch.Tensor, labels: torch.Tensor | None = None, dropout_key: DropoutKey | None = None, cache=None
    ) -> torch.Tensor:
        if self.has_embedding:
            x = self.embedding(x)  # (B, S) -> (B, S, H)
            x = keyed_dropout(x, self.cfg.hidden_dropout, dropout_key, -1, "embedding")
        x = self._run_layers(x, dropout_key, cache)
        if not self.has_head:
            return x
        if self.tracer is None:
            return self._head(x, labels)
        with self.tracer.span(spans.LOSS):
            return self._head(x, labels)

    def _run_layers(self, x: torch.Tensor, dropout_key: DropoutKey | None, cache=None) -> torch.Tensor:
        blocks = list(self.layers.values())
        cos, sin = self.rope_cos, self.rope_sin
        if cache is not None:  # per-row positions (B, S) -> tables (B, 1, S, D/2), broadcast over heads
            cos, sin = cos[cache.positions].unsqueeze(1), sin[cache.positions].unsqueeze(1)

        def run(h, start, end):
            for block in blocks[start:end]:
                h = block(h, cos, sin, self.tracer, dropout_key, cache)
            return h

        for start, end, recomputed in compute_full_recompute_groups(len(blocks), self.options.recompute):
            if recomputed and self.training:
                tracker = self.options.rng_tracker if self.cfg.attention_dropout else None
                x = recompute(run, x, start, end, rng_tracker=tracker)
            else:
                x = run(x, start, end)
        return x

    def overlap_units(self) -> list[tuple[nn.Module, list[nn.Parameter]]]:
        """(module, params) in forward order: the update of `params` lands before `module` runs
        (engine/overlap_update.py). The head runs as one compiled function, whose modules' hooks
        would run inside the graph, so its update is waited for before the last layer instead."""
        units: list[tuple[nn.Module, list[nn.Parameter]]] = []
        if self.has_embedding:
            units.append((self.embedding, list(self.embedding.parameters())))
        units += [(block, list(block.parameters())) for block in self.layers.values()]
        if self.has_head:
            head = list(self.final_norm.parameters()) + list(self.output.parameters())
            module, params = units[-1] if units else (self, [])
            units[-1:] = [(module, params + head)]
        return units

    def _head(self, x: torch.Tensor, labels: torch.Tensor | None) -> torch.Tensor:
        logits = self.output(self.final_norm(x))  # (B, S, V/TP), sequence gathered
        if labels is None:
            return logits
        vocab_start = self.tp.rank * logits.shape[-1]
        losses = vocab_parallel_cross_entropy(logits.flatten(0, 1), labels.flatten(), self.tp.group, vocab_start)
        return losses.view(labels.shape)


def apply_compile(chunks: list[GPTChunk]) -> None:
    """torch.compile the local math of every block (attention, MLP) and the output head.

    Regional compilation: blocks of one class share one compiled graph, TP communication is
    excluded from the graphs (see parallel.mappings), and tracer spans stay in eager code
    around the compiled regions. With hidden dropout on, the keyed dropout and residual add
    stay eager (compiling them would specialise the graph per layer index).
    """
    for chunk in chunks:
        for block in chunk.layers.values():
            if chunk.cfg.hidden_dropout:
                block.attention.attn.compile()
                block.mlp.mlp.compile()
            else:
                block.attention.compile()
                block.mlp.compile()
        if chunk.has_head:
            chunk._head = torch.compile(chunk._head)


def compile_counts() -> dict:
    """What dynamo has compiled in this process: frames and graph breaks. Blocks of one class
    share their graphs, so frames must not grow with the number of layers: a per-layer guard
    recompiles each block, and past dynamo's recompile limit (8) the rest run eager."""
    from torch._dynamo.utils import counters

    return {"frames": counters["frames"]["total"], "graph_breaks": sum(counters["graph_break"].values())}


def build_model_chunks(
    cfg: ModelConfig,
    *,
    pp_rank: int,
    pp_size: int,
    num_chunks: int,
    tp: TPContext,
    seed: int,
    device="cpu",
    options: ChunkOptions | None = None,
    stage_layers: tuple[int, ...] = (),
) -> list[GPTChunk]:
    """The model chunks a pipeline rank holds, initialised from the layout-independent full weights;
    `stage_layers` is the partition (parallel/partition.py), () for the even split."""
    counts = stage_layers or compute_stage_layers(cfg.num_layers, pp_size, num_chunks)
    ranges = compute_chunk_layer_ranges(counts, pp_size)[pp_rank]
    return [GPTChunk(cfg, first, last, tp, seed, device, options) for first, last in ranges]
