"""The same samples as Megatron-Core itself, where `megatron-core` is installed (skipped otherwise):
`pip install megatron-core` (its wheel ships the compiled index helpers; CPU is enough)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from megatron_format import write_pair
from test_indexed_data import _documents

from megatronapp.data.config import DataConfig
from megatronapp.data.preprocess import PreprocessConfig, preprocess_data
from megatronapp.data.sources import build_datasets
from megatronapp.data.tokenizer import ByteTokenizer


class _MegatronTokenizerStub:
    """What Megatron-Core's GPTDataset reads of a tokenizer when nothing is masked or reset."""

    eod, pad, vocab_size = 255, 0, 256
    unique_identifiers = {"class": "stub"}


def megatron_core_matches(rank: int, world: int, root: str, cases: list) -> list[bool]:
    """For each (Megatron blend, blend_per_split, split, sizes, our DataConfig): whether Megatron-Core's
    GPTDataset/BlendedDataset samples equal ours, split by split, in length and content."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    results = []
    for i, (blend, per_split, split, sizes, ours_config) in enumerate(cases):
        config = GPTDatasetConfig(
            random_seed=1234 + i,
            sequence_length=16,
            blend=blend,
            blend_per_split=per_split,
            split=split,
            tokenizer=_MegatronTokenizerStub(),
            reset_position_ids=False,
            reset_attention_mask=False,
            eod_mask_loss=False,
            path_to_cache=f"{root}/cache{i}",
        )
        theirs = BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, config).build()
        ours = build_datasets(ours_config, seq_length=16, seed=1234 + i, num_samples=tuple(sizes))
        for t, o in zip(theirs, ours):
            if t is None or o is None:
                results.append(t is None and o is None)
                continue
            mine = o.get_samples(np.arange(len(o)))
            results.append(
                len(t) == len(o) and all(np.array_equal(t[k]["tokens"], mine[k, :-1]) for k in range(len(t)))
            )
    return results


def test_samples_match_megatron_core_when_installed(cluster, tmp_path):
    pytest.importorskip("megatron.core.datasets.gpt_dataset", reason="megatron-core is not installed")
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    write_pair(a, _documents(1000, seed=13, high=250, max_len=60))
    write_pair(b, _documents(700, seed=14, high=250, max_len=60))
    cases = [
        (([a], None), None, "969,30,1", [2000, 100, 20], DataConfig(data_path=(a,))),
        (
            ([a, b], [0.3, 0.7]),
            None,
            "98,1,1",
            [5000, 200, 50],
            DataConfig(data_path=("0.3", a, "0.7", b), split="98,1,1"),
        ),
        (([a, b], None), None, "90,10,0", [3000, 100, 0], DataConfig(data_path=(a, b), split="90,10,0")),
        (
            None,
            [([a, b], [0.5, 0.5]), ([b], None), None],
            None,
            [3000, 300, 0],
            DataConfig(train_data_path=("0.5", a, "0.5", b), valid_data_path=(b,)),
        ),
    ]
    assert all(cluster.run(megatron_core_matches, 1, str(tmp_path), cases)[0])


def test_megatron_core_reads_preprocess_output_when_installed(tmp_path):
    indexed_dataset = pytest.importorskip(
        "megatron.core.datasets.indexed_dataset", reason="megatron-core is not installed"
    )
    corpus = tmp_path / "corpus.jsonl"
    texts = [f"line {i} " * (1 + i % 5) for i in range(200)]
    corpus.write_text("\n".join(json.dumps({"text": t}) for t in texts))
    config = PreprocessConfig(str(corpus), str(tmp_path / "c"), append_eod=True)
    preprocess_data(config, show_progress=False)
    theirs = indexed_dataset.IndexedDataset(config.output_prefixes()["text"])
    tok = ByteTokenizer()
    assert [theirs[i].tolist() for i in range(len(theirs))] == [tok.encode(t) + [tok.eod_id] for t in texts]
    assert theirs.document_indices.tolist() == list(range(201))
