"""Tokenizer files for an exported Hugging Face model directory.

The engine's ByteTokenizer (ids 0..255 = UTF-8 bytes, 256 = end of document) is exactly a
`tokenizers` BPE over GPT-2's byte-to-unicode alphabet with no merges, a ByteLevel
pre-tokenizer that does not split or add a prefix space, and one added special token
for id 256. `build_byte_tokenizer` builds that; a run trained on a Hugging Face
`tokenizer.json` gets its file copied instead. One difference: `tokenizers` always matches
added tokens, so the literal text "<|endoftext|>" encodes to id 256 (as with GPT-NeoX's own
tokenizer) where ByteTokenizer gives its 13 bytes.
"""

from __future__ import annotations

import json
import os

from megatronapp.data.tokenizer import ByteTokenizer, HFTokenizer

BYTE_EOD_TOKEN = "<|endoftext|>"  # the first name the engine looks for (data.tokenizer.EOD_TOKEN_CANDIDATES)


def compute_bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table (ByteLevel's alphabet)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def build_byte_tokenizer():
    """A `tokenizers.Tokenizer` giving the same ids as ByteTokenizer (EOD = 256)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {char: byte for byte, char in compute_bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(BYTE_EOD_TOKEN, special=True, normalized=False)])
    assert tok.token_to_id(BYTE_EOD_TOKEN) == ByteTokenizer.EOD_ID
    return tok


def compute_tokenizer_files(tokenizer_json: str | None, eod_token: str | None, max_length: int) -> dict[str, str]:
    """file name -> text of tokenizer.json, tokenizer_config.json and special_tokens_map.json.

    `tokenizer_json` None means the byte tokenizer. `eod_token` (the end-of-document token's
    name, None when the vocabulary has none) becomes eos/bos, as in GPT-NeoX's own files.
    """
    if tokenizer_json is None:
        tokenizer_json, eod_token = build_byte_tokenizer().to_str(pretty=True), BYTE_EOD_TOKEN
    special = {"bos_token": eod_token, "eos_token": eod_token, "unk_token": eod_token} if eod_token else {}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": max_length,
        "clean_up_tokenization_spaces": False,
        **special,
    }
    return {
        "tokenizer.json": tokenizer_json,
        "tokenizer_config.json": json.dumps(config, indent=2),
        "special_tokens_map.json": json.dumps(special, indent=2),
    }


def describe_hf_tokenizer(path: str | os.PathLike) -> tuple[str, str | None, HFTokenizer]:
    """(tokenizer.json text, end-of-document token name or None, the engine's view of it)."""
    from tokenizers import Tokenizer

    tok = HFTokenizer(path)
    return tok.path.read_text(), Tokenizer.from_file(str(tok.path)).id_to_token(tok.eod_id), tok
