"""The model's shape and its named presets (Megatron's model flags), and activation recompute."""

from __future__ import annotations

from dataclasses import dataclass, replace

from megatronapp.config.errors import ConfigError

NORMALIZATIONS = ("LayerNorm", "RMSNorm")
RECOMPUTE_GRANULARITIES = ("none", "selective", "full")
RECOMPUTE_METHODS = ("uniform", "block")


@dataclass(frozen=True)
class RecomputeConfig:
    """Activation recompute (Megatron's --recompute-*); model/recompute.py applies it."""

    granularity: str = "none"  # none | selective | full
    method: str = "uniform"  # uniform | block (full only)
    num_layers: int = 1  # layers per group (uniform) or layers per chunk recomputed (block)

    def __post_init__(self) -> None:
        if self.granularity not in RECOMPUTE_GRANULARITIES:
            raise ValueError(
                f"unknown recompute granularity {self.granularity!r}; choose from {', '.join(RECOMPUTE_GRANULARITIES)}"
            )
        if self.method not in RECOMPUTE_METHODS:
            raise ValueError(f"unknown recompute method {self.method!r}; choose from {', '.join(RECOMPUTE_METHODS)}")
        if self.num_layers < 1:
            raise ValueError(f"recompute num layers must be >= 1, got {self.num_layers}")


@dataclass(frozen=True)
class ModelConfig:
    """GPT decoder shape. Positions are rotary (RoPE): no position table to shard or pipe.

    The defaults are the GPT-NeoX family (LayerNorm, GeLU MLP, biases, multi-head attention,
    untied output layer); the Llama family sets RMSNorm, SwiGLU, grouped-query attention
    (`num_query_groups` key/value heads shared by the query heads), no linear biases (Qwen2:
    a QKV bias) and tied embeddings. Field names follow Megatron-LM's flags.
    """

    num_layers: int = 4
    hidden_size: int = 64
    num_attention_heads: int = 4
    ffn_hidden_size: int = 0  # 0 -> 4 * hidden_size
    vocab_size: int = 257  # tokenizer vocabulary before padding
    make_vocab_size_divisible_by: int = 128
    seq_length: int = 64
    layernorm_epsilon: float = 1e-5
    init_method_std: float = 0.02
    rotary_base: float = 10000.0
    hidden_dropout: float = 0.1  # Megatron-LM's defaults; every preset below sets 0.0
    attention_dropout: float = 0.1
    normalization: str = "LayerNorm"  # LayerNorm | RMSNorm
    swiglu: bool = False  # MLP: fc2(silu(gate(x)) * fc1(x)) instead of fc2(gelu(fc1(x)))
    num_query_groups: int | None = None  # key/value heads (grouped-query attention); None: one per head
    add_bias_linear: bool = True
    add_qkv_bias: bool = False  # a bias on the QKV projection even without add_bias_linear
    untie_embeddings_and_output_weights: bool = True  # False: the output layer is the input embedding

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_attention_heads", "vocab_size", "seq_length"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.hidden_size % self.num_attention_heads != 0:
            raise ConfigError(
                f"hidden size {self.hidden_size} is not divisible by num attention heads {self.num_attention_heads}"
            )
        if self.head_dim % 2 != 0:
            raise ConfigError(f"head dim {self.head_dim} must be even for rotary embeddings")
        for name in ("hidden_dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ConfigError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        if self.normalization not in NORMALIZATIONS:
            raise ConfigError(f"unknown normalization {self.normalization!r}; choose from {', '.join(NORMALIZATIONS)}")
        if self.num_query_groups is not None and (
            self.num_query_groups < 1 or self.num_attention_heads % self.num_query_groups
        ):
            raise ConfigError(
                f"num attention heads {self.num_attention_heads} is not divisible by num query groups "
                f"{self.num_query_groups}"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def query_groups(self) -> int:
        """Key/value heads: num_query_groups, or one per attention head (multi-head attention)."""
        return self.num_query_groups or self.num_attention_heads

    @property
    def qkv_bias(self) -> bool:
        return self.add_bias_linear or self.add_qkv_bias

    @property
    def ffn_size(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def padded_vocab_size(self) -> int:
        # Padding does not depend on TP (unlike Megatron), so every layout trains the
        # same model; divisibility by TP is checked in validate_job instead.
        m = self.make_vocab_size_divisible_by
        return -(-self.vocab_size // m) * m

    def num_parameters(self, include_input_embedding: bool = True) -> int:
        h, f, v, n = self.hidden_size, self.ffn_size, self.padded_vocab_size, self.num_layers
        norm = h if self.normalization == "RMSNorm" else 2 * h
        qkv_out = h + 2 * self.query_groups * self.head_dim
        bias = int(self.add_bias_linear)
        attention = qkv_out * h + qkv_out * int(self.qkv_bias) + h * h + h * bias
        fc1s = 2 if self.swiglu else 1
        mlp = fc1s * (h * f + f * bias) + f * h + h * bias
        per_layer = 2 * norm + attention + mlp
        # tied: the output layer is the input embedding, counted once (as the output layer
        # when the input embedding is left out)
        embedding = v * h if include_input_embedding and self.untie_embeddings_and_output_weights else 0
        return n * per_layer + embedding + v * h + norm

    def flops_per_token(self) -> float:
        """Training FLOPs per token, the one convention for every MFU we report:
        6 * N with N excluding the input embedding (a lookup, not a matmul; the output layer
        counts) + 12 * layers * hidden * seq for attention scores and values."""
        n = self.num_parameters(include_input_embedding=False)
        return 6.0 * n + 12.0 * self.num_layers * self.hidden_size * self.seq_length


_NO_DROPOUT = dict(hidden_dropout=0.0, attention_dropout=0.0)  # as current LLM pretraining recipes
_LLAMA = dict(
    normalization="RMSNorm",
    layernorm_epsilon=1e-5,
    swiglu=True,
    add_bias_linear=False,
    untie_embeddings_and_output_weights=False,
)
MODEL_PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=32, **_NO_DROPOUT),
    "demo": ModelConfig(num_layers=4, hidden_size=128, num_attention_heads=4, seq_length=128, **_NO_DROPOUT),
    "small": ModelConfig(num_layers=12, hidden_size=512, num_attention_heads=8, seq_length=256, **_NO_DROPOUT),
    "125m": ModelConfig(num_layers=12, hidden_size=768, num_attention_heads=12, seq_length=1024, **_NO_DROPOUT),
    "350m": ModelConfig(num_layers=24, hidden_size=1024, num_attention_heads=16, seq_length=2048, **_NO_DROPOUT),
    "1.3b": ModelConfig(num_layers=24, hidden_size=2048, num_attention_heads=16, seq_length=2048, **_NO_DROPOUT),
    # Llama 3.2 1B's shape (its vocabulary comes from --tokenizer-model, as for every preset)
    "llama3.2-1b": ModelConfig(
        num_layers=16,
        hidden_size=2048,
        num_attention_heads=32,
        num_query_groups=8,
        ffn_hidden_size=8192,
        seq_length=2048,
        rotary_base=500000.0,
        **_LLAMA,
        **_NO_DROPOUT,
    ),
    "llama-tiny": ModelConfig(
        num_layers=4,
        hidden_size=32,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=96,
        seq_length=32,
        rotary_base=500000.0,
        **_LLAMA,
        **_NO_DROPOUT,
    ),
}


def model_preset(name: str, **overrides) -> ModelConfig:
    if name not in MODEL_PRESETS:
        raise ConfigError(f"unknown model preset {name!r}; choose from {', '.join(MODEL_PRESETS)}")
    return replace(MODEL_PRESETS[name], **overrides)
