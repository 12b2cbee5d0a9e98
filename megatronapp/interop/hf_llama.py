"""The engine's Llama-family GPT <-> Hugging Face `LlamaForCausalLM` and `Qwen2ForCausalLM`:
config and weight mapping (export and import share it).

Why the engine's Llama-family GPT is a Llama (checked against transformers' modeling_llama.py
and modeling_qwen2.py, and by the logit-equality tests):
- LlamaDecoderLayer: h = h + o_proj(attn(input_layernorm(h))), then
  h = h + down_proj(silu(gate_proj(x)) * up_proj(x)) with x = post_attention_layernorm(h):
  our pre-norm Block with RMSNorm and SwiGLU (gate = gate_proj, fc1 = up_proj, fc2 = down_proj).
- LlamaRMSNorm is x * rsqrt(mean(x^2) + eps) * weight, computed in fp32: F.rms_norm.
- q_proj, k_proj and v_proj are separate; query head i uses key/value head
  i // (heads / num_key_value_heads) (repeat_kv): our fused qkv with rows ordered
  (group, [q_1 .. q_{heads/groups}, k, v], head_dim) holds the same rows, regrouped.
- Rotary with rotate_half on the whole head dim and inv_freq = theta ** (-2i / head_dim):
  ours (`rope_type: default` only; Llama 3's frequency scaling is refused).
- Llama: `attention_bias` puts biases on q, k, v and o, `mlp_bias` on the MLP: the engine's
  add_bias_linear (both or neither). Qwen2: biases on q, k, v only: add_qkv_bias without
  add_bias_linear.
- `tie_word_embeddings`: the output layer is the embedding (no lm_head in the file).
"""

from __future__ import annotations

import torch

from megatronapp.config import ConfigError, ModelConfig
from megatronapp.interop.hf_gptneox import InteropError, compute_vocab_divisor

LLAMA, QWEN2 = "llama", "qwen2"
HF_ARCHITECTURES = {LLAMA: "LlamaForCausalLM", QWEN2: "Qwen2ForCausalLM"}

# LlamaConfig's / Qwen2Config's defaults for the fields read here (save_pretrained leaves out
# fields equal to their default, so reading a config.json needs them)
HF_DEFAULTS = {
    LLAMA: {
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "hidden_act": "silu",
        "max_position_embeddings": 2048,
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
    },
    QWEN2: {
        "vocab_size": 151936,
        "hidden_size": 4096,
        "intermediate_size": 22016,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "hidden_act": "silu",
        "max_position_embeddings": 32768,
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "use_sliding_window": False,
    },
}

# engine name after "layers.{i}." -> Hugging Face name after "model.layers.{i}." (qkv: below)
_LAYER_NAMES = {
    "attention.norm.weight": "input_layernorm.weight",
    "attention.attn.proj.weight": "self_attn.o_proj.weight",
    "attention.attn.proj.bias": "self_attn.o_proj.bias",
    "mlp.norm.weight": "post_attention_layernorm.weight",
    "mlp.mlp.gate.weight": "mlp.gate_proj.weight",
    "mlp.mlp.gate.bias": "mlp.gate_proj.bias",
    "mlp.mlp.fc1.weight": "mlp.up_proj.weight",
    "mlp.mlp.fc1.bias": "mlp.up_proj.bias",
    "mlp.mlp.fc2.weight": "mlp.down_proj.weight",
    "mlp.mlp.fc2.bias": "mlp.down_proj.bias",
}
_QKV = ("q_proj", "k_proj", "v_proj")
_IGNORED_HF_SUFFIXES = (".rotary_emb.inv_freq",)


def llama_family(cfg: ModelConfig) -> str | None:
    """LLAMA or QWEN2 when `cfg` is expressible as that Hugging Face model, else None."""
    if cfg.normalization != "RMSNorm" or not cfg.swiglu:
        return None
    return QWEN2 if cfg.add_qkv_bias and not cfg.add_bias_linear else LLAMA


def compute_hf_config(cfg: ModelConfig, *, eos_id: int | None, dtype: torch.dtype) -> dict:
    """config.json of the LlamaForCausalLM / Qwen2ForCausalLM equal to `cfg` (eval mode)."""
    family = llama_family(cfg)
    config = {
        "architectures": [HF_ARCHITECTURES[family]],
        "model_type": family,
        "vocab_size": cfg.padded_vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.ffn_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.query_groups,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.seq_length,
        "initializer_range": cfg.init_method_std,
        "rms_norm_eps": cfg.layernorm_epsilon,
        "rope_theta": cfg.rotary_base,  # transformers 4.x key
        "rope_parameters": {"rope_theta": cfg.rotary_base, "rope_type": "default"},  # 5.x
        "tie_word_embeddings": not cfg.untie_embeddings_and_output_weights,
        "attention_dropout": cfg.attention_dropout,
        "bos_token_id": eos_id,
        "eos_token_id": eos_id,
        "use_cache": True,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    if family == LLAMA:
        config.update(attention_bias=cfg.add_bias_linear, mlp_bias=cfg.add_bias_linear)
    else:
        config.update(use_sliding_window=False)
    return config


def compute_hf_names(cfg: ModelConfig) -> dict[str, str]:
    """Engine parameter name -> Hugging Face key, for every parameter but the fused qkv."""
    names = {"embedding.weight": "model.embed_tokens.weight", "final_norm.weight": "model.norm.weight"}
    if cfg.untie_embeddings_and_output_weights:
        names["output.weight"] = "lm_head.weight"
    for i in range(cfg.num_layers):
        for ours, theirs in _LAYER_NAMES.items():
            if ours.endswith(".bias") and not cfg.add_bias_linear:
                continue
            names[f"layers.{i}.{ours}"] = f"model.layers.{i}.{theirs}"
    return names


def _rope_settings(hf: dict) -> tuple[float, str]:
    """(theta, rope type) from the 5.x `rope_parameters` or the 4.x `rope_theta` / `rope_scaling`."""
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    return float(theta), str(rope.get("rope_type", rope.get("type", "default")))


def check_expressible(hf: dict) -> None:
    """Raise InteropError naming the first Llama / Qwen2 setting the engine cannot express."""
    family = hf.get("model_type")
    get = lambda key: hf.get(key, HF_DEFAULTS[family].get(key))
    heads, hidden = get("num_attention_heads"), get("hidden_size")
    kind = _rope_settings(hf)[1]
    problems = [
        (kind != "default", f"rope_type: {kind!r} (the engine has plain RoPE only)"),
        (get("hidden_act") != "silu", f"hidden_act: {get('hidden_act')!r} (the engine's SwiGLU uses 'silu')"),
        (
            hf.get("head_dim", hidden // heads) != hidden // heads,
            f"head_dim: {hf.get('head_dim')} (the engine's is hidden_size / num_attention_heads = {hidden // heads})",
        ),
        (
            family == LLAMA and get("attention_bias") != get("mlp_bias"),
            "attention_bias and mlp_bias differ (the engine has biases on every linear or on none)",
        ),
        (family == QWEN2 and get("use_sliding_window"), "use_sliding_window: true (the engine attends to all tokens)"),
    ]
    for bad, message in problems:
        if bad:
            raise InteropError(message)


def compute_model_config(hf: dict, tokenizer_vocab: int | None = None) -> ModelConfig:
    """The engine's ModelConfig equal to a Llama / Qwen2 config.json; InteropError names what does not fit."""
    check_expressible(hf)
    family = hf["model_type"]
    get = lambda key: hf.get(key, HF_DEFAULTS[family].get(key))
    padded = int(get("vocab_size"))
    vocab = padded if tokenizer_vocab is None else tokenizer_vocab
    if vocab > padded:
        raise InteropError(f"vocab_size: {padded} is smaller than the tokenizer's {vocab} ids")
    biases = family == LLAMA and bool(get("attention_bias"))
    try:
        return ModelConfig(
            num_layers=get("num_hidden_layers"),
            hidden_size=get("hidden_size"),
            num_attention_heads=get("num_attention_heads"),
            num_query_groups=hf.get("num_key_value_heads") or get("num_attention_heads"),
            ffn_hidden_size=get("intermediate_size"),
            vocab_size=vocab,
            make_vocab_size_divisible_by=compute_vocab_divisor(padded, vocab),
            seq_length=get("max_position_embeddings"),
            layernorm_epsilon=float(get("rms_norm_eps")),
            init_method_std=float(get("initializer_range")),
            rotary_base=_rope_settings(hf)[0],
            hidden_dropout=0.0,
            attention_dropout=float(hf.get("attention_dropout", 0.0)),
            normalization="RMSNorm",
            swiglu=True,
            add_bias_linear=biases,
            add_qkv_bias=family == QWEN2,
            untie_embeddings_and_output_weights=not get("tie_word_embeddings"),
        )
    except ConfigError as exc:
        raise InteropError(f"config.json: {exc}") from None


def _qkv_rows(cfg: ModelConfig) -> tuple[int, int, int]:
    """(groups, query heads per group, head dim) of the fused qkv's rows."""
    return cfg.query_groups, cfg.num_attention_heads // cfg.query_groups, cfg.head_dim


def split_fused_qkv(fused: torch.Tensor, cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Our qkv weight (rows, H) or bias (rows,) -> q_proj, k_proj, v_proj (their rows, ...)."""
    groups, per_group, d = _qkv_rows(cfg)
    rows = fused.view(groups, per_group + 2, d, *fused.shape[1:])
    tail = fused.shape[1:]
    q = rows[:, :per_group].reshape(groups * per_group * d, *tail)
    k, v = (rows[:, per_group + i].reshape(groups * d, *tail) for i in (0, 1))
    return q, k, v


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """q_proj, k_proj, v_proj -> our fused qkv rows (inverse of split_fused_qkv)."""
    groups, per_group, d = _qkv_rows(cfg)
    tail = q.shape[1:]
    parts = (q.view(groups, per_group, d, *tail), k.view(groups, 1, d, *tail), v.view(groups, 1, d, *tail))
    return torch.cat(parts, dim=1).reshape(-1, *tail)


def _qkv_kinds(cfg: ModelConfig) -> tuple[str, ...]:
    return ("weight", "bias") if cfg.qkv_bias else ("weight",)


def convert_to_hf_tensors(state: dict[str, torch.Tensor], cfg: ModelConfig, dtype: torch.dtype) -> dict:
    """Engine full tensors -> Llama / Qwen2 safetensors dict (same values; `dtype`)."""
    names = compute_hf_names(cfg)
    qkv = {f"layers.{i}.attention.attn.qkv.{k}" for i in range(cfg.num_layers) for k in _qkv_kinds(cfg)}
    expected = set(names) | qkv | ({"output.weight"} if not cfg.untie_embeddings_and_output_weights else set())
    if set(state) != expected:
        odd = sorted(set(state) ^ expected)
        raise InteropError(f"checkpoint parameters do not form this {cfg.num_layers}-layer model (e.g. {odd[0]})")
    out = {theirs: state[ours] for ours, theirs in names.items()}
    for name in qkv:
        layer, kind = name.split(".")[1], name.rsplit(".", 1)[1]
        for proj, t in zip(_QKV, split_fused_qkv(state[name], cfg)):
            out[f"model.layers.{layer}.self_attn.{proj}.{kind}"] = t
    return {k: t.to(dtype).contiguous() for k, t in out.items()}


def convert_from_hf_tensors(tensors: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Llama / Qwen2 weights -> engine names, fp32 (a tied output layer is the embedding)."""
    tensors = {k: v for k, v in tensors.items() if not k.endswith(_IGNORED_HF_SUFFIXES)}
    if not cfg.untie_embeddings_and_output_weights:
        tensors.pop("lm_head.weight", None)  # some tied checkpoints store it anyway
    take = lambda key: _take(tensors, key).to(torch.float32)
    state = {ours: take(theirs) for ours, theirs in compute_hf_names(cfg).items()}
    for i in range(cfg.num_layers):
        for kind in _qkv_kinds(cfg):
            q, k, v = (take(f"model.layers.{i}.self_attn.{proj}.{kind}") for proj in _QKV)
            state[f"layers.{i}.attention.attn.qkv.{kind}"] = fuse_qkv(q, k, v, cfg)
    if tensors:
        raise InteropError(f"unexpected weight {sorted(tensors)[0]} (not part of this {cfg.num_layers}-layer model)")
    if not cfg.untie_embeddings_and_output_weights:
        state["output.weight"] = state["embedding.weight"].clone()
    return state


def _take(tensors: dict, key: str) -> torch.Tensor:
    if key not in tensors:
        raise InteropError(f"missing weight {key}")
    return tensors.pop(key)
