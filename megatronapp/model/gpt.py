"""GPT decoder with tensor parallelism, built as pipeline chunks.

Pre-norm blocks: x + Drop(Attn(Norm(x))), then x + Drop(MLP(Norm(x))). Causal attention
through torch's scaled_dot_product_attention (attention dropout inside it), rotary
positions and grouped-query attention (model/attention.py), a GeLU or SwiGLU MLP
(model/mlp.py), LayerNorm or RMSNorm, linear biases or none (ModelConfig names the family).
Hidden dropout is keyed (parallel/random.py), so its masks do not depend on the layout;
sequence parallelism and recompute are options of the same modules (parallel/layers.py,
model/recompute.py).

The output layer is untied by default (Megatron's --untie-embeddings-and-output-weights).
Tied, it is a second parameter initialised from the embedding's name, so it starts equal to
the embedding; the engine sums the two gradients before the update (GradReducer: in
one process, or over the embedding group between the first and last pipeline stage, as
Megatron does), so both take the same steps and stay equal.

A `GPTChunk` holds a contiguous range of layers; the chunk with layer 0 also holds the
embedding, the chunk with the last layer the final norm, output head and loss. Parameter
names use *global* layer indices ("layers.7.attn.qkv.weight"), so a checkpoint written under
one layout can be loaded under any other.
"""

from __future__ import annotations

import torch
from torch import nn

from megatronapp import spans
from megatronapp.config import ModelConfig
from megatronapp.model.attention import Attention, rotary_tables
from megatronapp.model.attention import apply_rotary as apply_rotary  # re-exported for plain twins
from megatronapp.model.layer_parts import ChunkOptions, TPContext, build_norm, tp_linear_kwargs
from megatronapp.model.mlp import MLP
from megatronapp.model.recompute import compute_full_recompute_groups, recompute
from megatronapp.parallel.cross_entropy import vocab_parallel_cross_entropy
from megatronapp.parallel.eager_only import prepare_compile
from megatronapp.parallel.layers import ColumnParallelLinear, VocabParallelEmbedding
from megatronapp.parallel.partition import compute_chunk_layer_ranges, compute_stage_layers
from megatronapp.parallel.random import DropoutKey, keyed_dropout


class ResidualAttention(nn.Module):
    """x + dropout(Attn(LN(x))): the unit compiled as one region (norm and residual fused in)."""

    def __init__(
        self, name: str, layer: int, cfg: ModelConfig, tp: TPContext, seed: int, device, options: ChunkOptions
    ):
        super().__init__()
        self.layer, self.dropout_p = layer, cfg.hidden_dropout
        self.norm = build_norm(cfg, tp, device)
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
        self.norm = build_norm(cfg, tp, device)
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
        kw = tp_linear_kwargs(tp, seed, device)
        if self.has_embedding:
            self.embedding = VocabParallelEmbedding(
                "embedding", cfg.padded_vocab_size, cfg.hidden_size, std=cfg.init_method_std, **kw
            )
            if not cfg.untie_embeddings_and_output_weights:
                self.embedding.weight.tied_embedding = "embedding"
        self.layers = nn.ModuleDict(
            {str(i): Block(i, cfg, tp, seed, device, self.options) for i in range(first_layer, last_layer)}
        )
        if self.has_head:
            self.final_norm = build_norm(cfg, tp, device)
            tied = not cfg.untie_embeddings_and_output_weights
            self.output = ColumnParallelLinear(
                "embedding" if tied else "output",  # the name seeds the initial weight
                cfg.hidden_size,
                cfg.padded_vocab_size,
                std=cfg.init_method_std,
                bias=False,
                **kw,
            )
            if tied:  # which side of the tie (engine/grads.py sums the pair's gradients)
                self.output.weight.tied_embedding = "output"
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
    prepare_compile()
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
