"""Megatron-LM's `--tokenizer-type` names, for the ones this program can honour.

    HuggingFaceTokenizer  --tokenizer-model tokenizer.json (or its folder)
    NullTokenizer         --vocab-size V: text is space-separated ids 0..V-1, EOD is V (vocab V + 1)
    ByteTokenizer         UTF-8 bytes, EOD 256 (this program's default; no Megatron equivalent)

Without `--tokenizer-type` the tokenizer follows `--tokenizer-model` (a tokenizer.json, else bytes).
Megatron's other names need vocabulary formats this program does not read; they are refused in
one line that says what to use instead.
"""

from __future__ import annotations

from megatronapp.data.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer

TOKENIZER_TYPES = ("HuggingFaceTokenizer", "NullTokenizer", "ByteTokenizer")
MEGATRON_ONLY_TYPES = (
    "BertWordPieceLowerCase",
    "BertWordPieceCase",
    "GPT2BPETokenizer",
    "SentencePieceTokenizer",
    "GPTSentencePieceTokenizer",
    "Llama2Tokenizer",
    "TikTokenizer",
    "MultimodalTokenizer",
    "NullMultimodalTokenizer",
)


class NullTokenizer:
    """Megatron's NullTokenizer: ids written as text ("17 4 99"), vocabulary 0..vocab_size-1 plus EOD."""

    def __init__(self, vocab_size: int) -> None:
        if vocab_size < 1:
            raise ValueError(f"--vocab-size must be >= 1, got {vocab_size}")
        self._eod_id = vocab_size

    @property
    def vocab_size(self) -> int:
        return self._eod_id + 1

    @property
    def eod_id(self) -> int:
        return self._eod_id

    def encode(self, text: str) -> list[int]:
        try:
            return [int(t) for t in text.split()]
        except ValueError:
            raise ValueError("NullTokenizer reads space-separated integer ids") from None

    def decode(self, ids: list[int]) -> str:
        return " ".join(str(int(i)) for i in ids)


def build_tokenizer(
    tokenizer_type: str | None, tokenizer_model: str | None = None, vocab_size: int | None = None
) -> Tokenizer:
    """The tokenizer the flags name; ValueError (one line) for a name or combination it cannot honour."""
    if tokenizer_type is None:
        if vocab_size is not None:
            raise ValueError("--vocab-size applies to --tokenizer-type NullTokenizer")
        return load_tokenizer(tokenizer_model)
    if tokenizer_type in MEGATRON_ONLY_TYPES:
        raise ValueError(
            f"--tokenizer-type {tokenizer_type} is not supported; use HuggingFaceTokenizer with a "
            "tokenizer.json (tokenizers can convert vocab/merges files), NullTokenizer or ByteTokenizer"
        )
    if tokenizer_type not in TOKENIZER_TYPES:
        raise ValueError(f"--tokenizer-type {tokenizer_type!r} is unknown; choose from {', '.join(TOKENIZER_TYPES)}")
    if tokenizer_type == "NullTokenizer":
        if vocab_size is None or tokenizer_model is not None:
            raise ValueError("--tokenizer-type NullTokenizer needs --vocab-size and no --tokenizer-model")
        return NullTokenizer(vocab_size)
    if vocab_size is not None:
        raise ValueError("--vocab-size applies to --tokenizer-type NullTokenizer")
    if tokenizer_type == "HuggingFaceTokenizer":
        if tokenizer_model is None:
            raise ValueError("--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model tokenizer.json")
        return load_tokenizer(tokenizer_model)
    if tokenizer_model is not None:
        raise ValueError("--tokenizer-type ByteTokenizer takes no --tokenizer-model")
    return ByteTokenizer()
