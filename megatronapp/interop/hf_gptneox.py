"""The engine's GPT <-> Hugging Face `GPTNeoXForCausalLM`: config and weight mapping, export, import.

Why the engine's GPT is a GPT-NeoX (checked against transformers' modeling_gpt_neox.py, and
by the logit-equality tests):
- GPTNeoXLayer with `use_parallel_residual: false` computes h = h + attn(ln1(h)), then
  h = h + mlp(ln2(h)): our pre-LN Block.
- `query_key_value` output is viewed as (B, S, heads, 3 * head_dim) and chunked into q|k|v,
  so its rows are ordered (head, [q|k|v], head_dim): our fused qkv layout, unchanged.
- Rotary on int(head_dim * rotary_pct) dims with rotate_half ([x1 cos - x2 sin, x2 cos + x1 sin]),
  inv_freq = base ** (-2i / dim): ours with `rotary_pct: 1.0`, `rotary_emb_base` = rotary_base.
- Attention scale head_dim ** -0.5 (SDPA's default), causal mask.
- `hidden_act: gelu_pytorch_tanh` is F.gelu(approximate="tanh"), our MLP ("gelu_new" is the same
  function computed with other float ops, so not bit-equal: it is refused on import).
- Biases on query_key_value and dense (`attention_bias: true`) and on both MLP linears; the
  output layer (`embed_out`, `lm_head` in transformers 5) has none and is untied from `embed_in`.
- `final_layer_norm` before the output layer; vocab_size is the engine's padded vocabulary.
"""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path

import torch

from megatronapp.config import ConfigError, ModelConfig
from megatronapp.files import atomic_path

HF_ARCHITECTURE = "GPTNeoXForCausalLM"
HF_ACTIVATION = "gelu_pytorch_tanh"

# GPTNeoXConfig's defaults (the same in transformers 4.x and 5.x). save_pretrained omits every
# field equal to its default, so reading a config.json needs them; a test compares them with
# the installed transformers.
GPTNEOX_DEFAULTS = {
    "vocab_size": 50432,
    "hidden_size": 6144,
    "num_hidden_layers": 44,
    "num_attention_heads": 64,
    "intermediate_size": 24576,
    "hidden_act": "gelu",
    "rotary_pct": 0.25,
    "rotary_emb_base": 10000.0,
    "attention_dropout": 0.0,
    "hidden_dropout": 0.0,
    "max_position_embeddings": 2048,
    "initializer_range": 0.02,
    "layer_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "use_parallel_residual": True,
    "attention_bias": True,
}

# engine name after "layers.{i}." -> GPT-NeoX name after "gpt_neox.layers.{i}."
_LAYER_NAMES = {
    "attention.norm": "input_layernorm",
    "attention.attn.qkv": "attention.query_key_value",
    "attention.attn.proj": "attention.dense",
    "mlp.norm": "post_attention_layernorm",
    "mlp.mlp.fc1": "mlp.dense_h_to_4h",
    "mlp.mlp.fc2": "mlp.dense_4h_to_h",
}
# Buffers some GPT-NeoX checkpoints carry (causal mask, rotary table): derived, not weights.
_IGNORED_HF_SUFFIXES = (".attention.bias", ".attention.masked_bias", ".rotary_emb.inv_freq")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class InteropError(ValueError):
    """A model or file that cannot be converted; the message names the field, in one line."""


def compute_hf_names(num_layers: int) -> dict[str, str]:
    """Engine parameter name -> GPT-NeoX safetensors key, for every parameter of the model."""
    names = {
        "embedding.weight": "gpt_neox.embed_in.weight",
        "final_norm.weight": "gpt_neox.final_layer_norm.weight",
        "final_norm.bias": "gpt_neox.final_layer_norm.bias",
        "output.weight": "embed_out.weight",
    }  # the on-disk name; transformers 5 renames it lm_head
    for i in range(num_layers):
        for ours, theirs in _LAYER_NAMES.items():
            for kind in ("weight", "bias"):
                names[f"layers.{i}.{ours}.{kind}"] = f"gpt_neox.layers.{i}.{theirs}.{kind}"
    return names


def compute_hf_config(cfg: ModelConfig, *, eos_id: int | None, dtype: torch.dtype) -> dict:
    """config.json of the GPTNeoXForCausalLM equal to `cfg` (eval mode; dropouts carried over)."""
    return {
        "architectures": [HF_ARCHITECTURE],
        "model_type": "gpt_neox",
        "vocab_size": cfg.padded_vocab_size,
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "intermediate_size": cfg.ffn_size,
        "hidden_act": HF_ACTIVATION,
        "rotary_pct": 1.0,
        "rotary_emb_base": cfg.rotary_base,
        "max_position_embeddings": cfg.seq_length,
        "initializer_range": cfg.init_method_std,
        "layer_norm_eps": cfg.layernorm_epsilon,
        "use_parallel_residual": False,
        "tie_word_embeddings": False,
        "attention_bias": True,
        "hidden_dropout": getattr(cfg, "hidden_dropout", 0.0),
        "attention_dropout": getattr(cfg, "attention_dropout", 0.0),
        "bos_token_id": eos_id,
        "eos_token_id": eos_id,
        "use_cache": True,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def _rope_settings(hf: dict) -> tuple[float, float, str]:
    """(theta, rotary fraction, rope type) from either the 4.x keys or 5.x `rope_parameters`."""
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    theta = rope.get("rope_theta", hf.get("rotary_emb_base", GPTNEOX_DEFAULTS["rotary_emb_base"]))
    fraction = rope.get("partial_rotary_factor", hf.get("rotary_pct", GPTNEOX_DEFAULTS["rotary_pct"]))
    kind = rope.get("rope_type", rope.get("type", "default"))
    return float(theta), float(fraction), str(kind)


def check_exportable(cfg: ModelConfig) -> None:
    """Raise InteropError naming the first setting of `cfg` a GPTNeoXForCausalLM cannot express."""
    problems = [
        (cfg.normalization != "LayerNorm", f"normalization {cfg.normalization} (GPT-NeoX has LayerNorm)"),
        (cfg.swiglu, "a SwiGLU MLP without RMSNorm (GPT-NeoX's MLP is GeLU; Llama's norm is RMSNorm)"),
        (cfg.query_groups != cfg.num_attention_heads, "grouped-query attention (GPT-NeoX has multi-head attention)"),
        (not cfg.add_bias_linear, "no linear biases (GPT-NeoX has them)"),
        (not cfg.untie_embeddings_and_output_weights, "tied embeddings (GPT-NeoX's are untied)"),
    ]
    for bad, message in problems:
        if bad:
            raise InteropError(f"cannot export as {HF_ARCHITECTURE}: {message}")


def check_expressible(hf: dict) -> None:
    """Raise InteropError naming the first GPT-NeoX setting the engine's GPT cannot express."""
    get = lambda key: hf.get(key, GPTNEOX_DEFAULTS.get(key))
    if hf.get("model_type") != "gpt_neox":
        raise InteropError(
            f"model_type: {hf.get('model_type')!r} (GPT-NeoX 'gpt_neox', Llama 'llama' and Qwen2 'qwen2' can be imported)"
        )
    _, fraction, kind = _rope_settings(hf)
    problems = [
        (get("use_parallel_residual"), "use_parallel_residual: true (the engine's layers are sequential; needs false)"),
        (fraction != 1.0, f"rotary_pct: {fraction} (the engine rotates the whole head dim; needs 1.0)"),
        (kind != "default", f"rope_type: {kind!r} (the engine has plain RoPE only)"),
        (get("tie_word_embeddings"), "tie_word_embeddings: true (the engine's embedding and output layer are untied)"),
        (
            get("hidden_act") != HF_ACTIVATION,
            f"hidden_act: {get('hidden_act')!r} (the engine's MLP is {HF_ACTIVATION!r}, F.gelu(approximate='tanh'))",
        ),
        (not get("attention_bias"), "attention_bias: false (the engine's attention has biases)"),
    ]
    for bad, message in problems:
        if bad:
            raise InteropError(message)


def compute_vocab_divisor(padded: int, tokenizer_vocab: int) -> int:
    """make_vocab_size_divisible_by that pads `tokenizer_vocab` exactly to `padded`.

    The largest power of two up to 128 (Megatron's default) that works, so the padded
    vocabulary splits over as many TP sizes as possible; `padded` itself always works.
    """
    for m in (128, 64, 32, 16, 8, 4, 2, 1):
        if padded % m == 0 and -(-tokenizer_vocab // m) * m == padded:
            return m
    return padded


def compute_model_config(hf: dict, tokenizer_vocab: int | None = None) -> ModelConfig:
    """The engine's ModelConfig equal to a GPT-NeoX config.json; InteropError names what does not fit."""
    check_expressible(hf)
    get = lambda key: hf.get(key, GPTNEOX_DEFAULTS[key])
    padded = int(get("vocab_size"))
    vocab = padded if tokenizer_vocab is None else tokenizer_vocab
    if vocab > padded:
        raise InteropError(f"vocab_size: {padded} is smaller than the tokenizer's {vocab} ids")
    theta, _, _ = _rope_settings(hf)
    ffn = get("intermediate_size")
    kwargs = dict(
        num_layers=get("num_hidden_layers"),
        hidden_size=get("hidden_size"),
        num_attention_heads=get("num_attention_heads"),
        ffn_hidden_size=0 if ffn == 4 * get("hidden_size") else ffn,  # 0: ModelConfig's "4 x hidden"
        vocab_size=vocab,
        make_vocab_size_divisible_by=compute_vocab_divisor(padded, vocab),
        seq_length=get("max_position_embeddings"),
        layernorm_epsilon=float(get("layer_norm_eps")),
        init_method_std=float(get("initializer_range")),
        rotary_base=theta,
    )
    known = {f.name for f in fields(ModelConfig)}
    for name in ("hidden_dropout", "attention_dropout"):  # ModelConfig fields in newer engine versions
        if name in known:
            kwargs[name] = float(get(name))
    try:
        return ModelConfig(**kwargs)
    except ConfigError as exc:
        raise InteropError(f"config.json: {exc}") from None


def convert_to_hf_tensors(
    state: dict[str, torch.Tensor], num_layers: int, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """Engine full tensors -> GPT-NeoX safetensors dict (same values; `dtype`)."""
    names = compute_hf_names(num_layers)
    if set(state) != set(names):
        odd = sorted(set(state) ^ set(names))
        raise InteropError(f"checkpoint parameters do not form a GPT of {num_layers} layers (e.g. {odd[0]})")
    return {names[n]: t.to(dtype).contiguous() for n, t in state.items()}


def convert_from_hf_tensors(tensors: dict[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
    """GPT-NeoX weights (either output-layer name, derived buffers ignored) -> engine names, fp32."""
    ours = {hf: name for name, hf in compute_hf_names(num_layers).items()}
    state = {}
    for key, tensor in tensors.items():
        key = "embed_out." + key.removeprefix("lm_head.") if key.startswith("lm_head.") else key
        if key.endswith(_IGNORED_HF_SUFFIXES):
            continue
        if key not in ours:
            raise InteropError(f"unexpected weight {key} (not part of a {num_layers}-layer GPT-NeoX)")
        state[ours[key]] = tensor.to(torch.float32)
    missing = sorted(hf for hf, name in ours.items() if name not in state)
    if missing:
        raise InteropError(f"missing weight {missing[0]}")
    return state


def load_hf_tensors(src: Path) -> dict[str, torch.Tensor]:
    """All tensors of a Hugging Face model folder: model.safetensors, a sharded index, or pytorch_model.bin."""
    from safetensors.torch import load_file

    if (src / "model.safetensors").is_file():
        return load_file(src / "model.safetensors")
    index = src / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return {k: v for f in files for k, v in load_file(src / f).items()}
    if (src / "pytorch_model.bin").is_file():
        return torch.load(src / "pytorch_model.bin", map_location="cpu", weights_only=True)
    raise FileNotFoundError(f"no model.safetensors, model.safetensors.index.json or pytorch_model.bin in {src}")


def save_hf_tensors(tensors: dict[str, torch.Tensor], out: Path) -> None:
    from safetensors.torch import save_file

    with atomic_path(out / "model.safetensors") as tmp:
        save_file(tensors, str(tmp), metadata={"format": "pt"})


def parse_dtype(name: str | None) -> torch.dtype | None:
    if name is None:
        return None
    if name not in _DTYPES:
        raise InteropError(f"dtype {name!r}: choose from {', '.join(_DTYPES)}")
    return _DTYPES[name]
