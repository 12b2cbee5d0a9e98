"""What a run reads its data from: the data flags of `megatronapp train`, Megatron-LM's names.

    --data-path a.txt b.jsonl dir/              text: documents, EOD-separated (data/dataset.py)
    --data-path PREFIX                          one indexed dataset PREFIX.bin/PREFIX.idx
    --data-path 0.3 A 0.7 B --split 969,30,1    a weighted blend, each prefix split by documents
    --train-data-path ... --valid-data-path ... --test-data-path ...   one blend per split

Indexed datasets are built into train/valid/test sample streams by data/sources.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatronapp.flags import Flag, add_flags

DEFAULT_SPLIT = "969,30,1"  # Megatron's default for --data-path when --split is not given


@dataclass(frozen=True)
class DataConfig:
    """The data flags as given; parsed and checked against the files by sources.check_data_config."""

    data_path: tuple[str, ...] = ()  # text files/folders, or [WEIGHT] PREFIX ...; empty: the synthetic corpus
    split: str | None = None  # train,valid,test shares of each prefix's documents; None: DEFAULT_SPLIT
    train_data_path: tuple[str, ...] = ()  # [WEIGHT] PREFIX ... of the train split alone
    valid_data_path: tuple[str, ...] = ()
    test_data_path: tuple[str, ...] = ()
    tokenizer_type: str | None = None  # Megatron's name (tokenizer_types.py); None: by --tokenizer-model
    tokenizer_model: str | None = None  # a Hugging Face tokenizer.json (or its folder)
    vocab_size: int | None = None  # NullTokenizer's ids 0..vocab_size-1 (EOD is vocab_size)

    @property
    def per_split_paths(self) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
        return self.train_data_path, self.valid_data_path, self.test_data_path

    @property
    def has_per_split_paths(self) -> bool:
        return any(self.per_split_paths)


def add_data_arguments(group) -> None:
    """`train`'s indexed-data and tokenizer-type flags (beside --data-path and --tokenizer-model)."""
    group.add_argument(
        "--split",
        default=None,
        help=f"indexed --data-path: train,valid,test shares of each prefix's documents (default: {DEFAULT_SPLIT})",
    )
    for name in ("train", "valid", "test"):
        group.add_argument(
            f"--{name}-data-path",
            nargs="+",
            default=None,
            metavar="PATH",
            help=f"the {name} split alone: indexed datasets (PREFIX or W1 PREFIX1 W2 PREFIX2 ...; excludes "
            "--data-path)"
            + ("" if name == "train" else ", or .txt / .jsonl files beside a text --data-path")
            + " (default: none)",
        )
    add_flags(group, TOKENIZER_FLAGS)


# Which tokenizer: `train` and `preprocess-data` take these (beside launch.flags.TOKENIZER_MODEL)
TOKENIZER_FLAGS = (
    Flag(
        "--tokenizer-type",
        None,
        "Megatron's name: HuggingFaceTokenizer (with --tokenizer-model), NullTokenizer "
        "(with --vocab-size) or ByteTokenizer; default: by --tokenizer-model",
    ),
    Flag("--vocab-size", None, "NullTokenizer's vocabulary, EOD excluded", {"type": int}),
)
