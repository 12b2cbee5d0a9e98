"""MegaScope capture and perturbation sites: names, meanings and the model modules behind them.

Per layer (the layer's Block in a GPTChunk):

    site        shape (full model)  source                                  TP sharding
    q, k, v     (B, heads, S, D)    qkv projection output, rotary applied    heads
                                    to q and k as the model does
    attn_probs  (B, heads, S, T)    softmax(q k^T / sqrt(D)) recomputed from heads
                                    q and the cached keys (the SDPA kernel
                                    itself stays in use); T = keys so far
    attn_out    (B, S, H)           attention block output (after proj)    replicated
    fc1         (B, S, F)           MLP activation = fc2 input: GeLU(fc1(x)),  F
                                    SwiGLU: silu(gate(x)) * fc1(x)
    mlp_out     (B, S, H)           MLP output (after fc2)                   replicated
    residual    (B, S, H)           residual stream after the layer          replicated

At the end of a step, on the serving rank: `topk` (top-k next-token ids and probabilities of
the newest column) and `logit_lens` (log-probabilities (L, B, V) of the newest column's
residual after each layer, through the final norm and output layer).

With grouped-query attention, the captured k and v are per query head (each group's
key/value head repeated for the query heads that share it), so a head index means the same
head at q, k, v and attn_probs.

Perturbations act on the same sites except attn_probs (computed inside the fused kernel);
at q / k / v they change the projection output before rotary, which is where a fault in that
matmul lands; with grouped-query attention a k or v perturbation's heads are key/value heads
(query groups), since that is the tensor the model computes.
"""

from __future__ import annotations

LAYER_SITES = ("q", "k", "v", "attn_probs", "attn_out", "fc1", "mlp_out", "residual")
FINAL_SITES = ("topk", "logit_lens")
ALL_SITES = LAYER_SITES + FINAL_SITES
HEAD_SITES = ("q", "k", "v", "attn_probs")
PERTURB_SITES = ("q", "k", "v", "attn_out", "fc1", "mlp_out", "residual")
DEFAULT_SITES = ("attn_out", "mlp_out", "residual", "topk", "logit_lens")


def check_sites(sites) -> tuple[str, ...]:
    """Validated tuple of site names (one-line ValueError on an unknown one)."""
    sites = tuple(sites)
    for s in sites:
        if s not in ALL_SITES:
            raise ValueError(f"unknown capture site {s!r}; choose from {', '.join(ALL_SITES)}")
    return sites


def check_layers(layers, num_layers: int) -> tuple[int, ...]:
    if layers is None:
        return tuple(range(num_layers))
    layers = tuple(int(x) for x in layers)
    for x in layers:
        if not 0 <= x < num_layers:
            raise ValueError(f"layer {x} is out of range (model has {num_layers} layers)")
    return layers


def check_heads(heads, num_heads: int) -> tuple[int, ...] | None:
    if heads is None:
        return None
    heads = tuple(int(h) for h in heads)
    for h in heads:
        if not 0 <= h < num_heads:
            raise ValueError(f"head {h} is out of range (model has {num_heads} heads)")
    return heads


def layer_modules(block) -> dict:
    """The modules of one Block that the sites hook (see the table above)."""
    attn = block.attention.attn
    return {"attn": attn, "qkv": attn.qkv, "fc2": block.mlp.mlp.fc2, "mlp": block.mlp.mlp, "block": block}


def site_numel(site: str, cfg, batch: int, new: int, total: int) -> int:
    """Elements of one layer's capture at `site` for a step of `new` columns (`total` keys)."""
    h, nh, d, f = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.ffn_size
    per = {
        "q": nh * new * d,
        "k": nh * new * d,
        "v": nh * new * d,
        "attn_probs": nh * new * total,
        "attn_out": new * h,
        "fc1": new * f,
        "mlp_out": new * h,
        "residual": new * h,
    }
    return batch * per[site]
