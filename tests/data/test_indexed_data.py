"""Megatron indexed datasets: files from an independent writer, GPTDataset's samples, blends,
splits, preprocess-data, one-line refusals, and TP2 x PP2 training on the same batches as one process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from megatron_format import CODES, read_pair, reference_blending, reference_sample, reference_samples, write_pair

from megatronapp.data.blend import compute_blending_indices
from megatronapp.data.config import DataConfig
from megatronapp.data.dataset import DistributedBatchIterator
from megatronapp.data.gpt_samples import IndexedGPTDataset
from megatronapp.data.indexed import IndexedDataset
from megatronapp.data.preprocess import PreprocessConfig, preprocess_data
from megatronapp.data.sources import build_datasets, compute_split_bounds, compute_split_num_samples
from megatronapp.data.tokenizer import ByteTokenizer


def _documents(n: int, seed: int = 0, low: int = 0, high: int = 120, max_len: int = 40) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(low, high, rng.integers(1, max_len)).tolist() for _ in range(n)]


# --------------------------------------------------------------------------- the files


@pytest.mark.parametrize("code", sorted(CODES), ids=[CODES[c] for c in sorted(CODES)])
@pytest.mark.parametrize("modes", [False, True], ids=["text", "with-modes"])
def test_reads_every_dtype_an_independent_writer_wrote(tmp_path, code, modes):
    docs = _documents(30, seed=code)
    write_pair(tmp_path / "d", docs, code=code, modes=modes)
    ds = IndexedDataset(tmp_path / "d")
    assert ds.dtype == np.dtype(CODES[code]) and len(ds) == 30 and ds.num_documents == 30
    for i, doc in enumerate(docs):
        np.testing.assert_array_equal(ds.get(i), np.asarray(doc, dtype=ds.dtype))
    longest = int(np.argmax([len(d) for d in docs]))
    np.testing.assert_array_equal(ds.get(longest, 1, 2), np.asarray(docs[longest][1:3], dtype=ds.dtype))


def test_samples_are_gpt_datasets_document_sample_and_shuffle_indices(tmp_path):
    docs = _documents(50, seed=1)
    write_pair(tmp_path / "d", docs)
    sequences, _ = read_pair(tmp_path / "d")
    lengths = [len(d) for d in docs]
    ids = np.arange(5, 45)
    tokens = sum(lengths[i] for i in ids)
    per_epoch, two_epochs = (tokens - 1) // 16, (2 * tokens - 1) // 16
    # the third epoch's share of an epoch's samples: 0.65 is shuffled apart (< 0.8), 0.9 is not
    third_epoch = [two_epochs + int(share * per_epoch) for share in (0.65, 0.9)]
    for num_samples in (None, 40, 300, 1000, *third_epoch):  # one epoch, several, with and without a separate last one
        ds = IndexedGPTDataset(IndexedDataset(tmp_path / "d"), ids, seq_length=16, seed=1234, num_samples=num_samples)
        document_index, sample_index, shuffle_index = reference_samples(lengths, ids, 16, 1234, num_samples)
        np.testing.assert_array_equal(ds.document_index, document_index)
        np.testing.assert_array_equal(ds.sample_index, sample_index)
        np.testing.assert_array_equal(ds.shuffle_index, shuffle_index)
        assert len(ds) >= (num_samples or 1)
        picks = np.arange(0, len(ds), 7)
        expected = [reference_sample(sequences, document_index, sample_index, shuffle_index[i]) for i in picks]
        np.testing.assert_array_equal(ds.get_samples(picks), np.stack(expected))
    assert ds.num_epochs > 1


def test_a_split_shorter_than_a_sample_repeats(tmp_path):
    write_pair(tmp_path / "d", [[1, 2, 3], [4, 5]])
    ds = IndexedGPTDataset(IndexedDataset(tmp_path / "d"), np.arange(2), seq_length=8, seed=0)
    assert (
        len(ds) == 1 and ds.num_epochs == 2 and sorted(ds.get_samples([0])[0].tolist()) == [1, 1, 2, 2, 3, 4, 4, 5, 5]
    )
    assert len(IndexedGPTDataset(IndexedDataset(tmp_path / "d"), np.arange(2), 8, 0, num_samples=10)) >= 10


def test_seed_changes_the_order_and_only_the_order(tmp_path):
    write_pair(tmp_path / "d", _documents(40, seed=2))
    a, b = (IndexedGPTDataset(IndexedDataset(tmp_path / "d"), np.arange(40), 8, seed) for seed in (1, 2))
    assert not np.array_equal(a.get_samples(np.arange(len(a))), b.get_samples(np.arange(len(b))))
    assert sorted(a.document_index.tolist()) == sorted(b.document_index.tolist())


def test_every_dp_size_reads_the_same_global_batches(tmp_path):
    write_pair(tmp_path / "d", _documents(80, seed=11))
    train = build_datasets(DataConfig(data_path=(str(tmp_path / "d"),)), seq_length=8, seed=5).train

    def global_batches(dp_size: int) -> list[torch.Tensor]:
        ranks = [
            DistributedBatchIterator(
                train, micro_batch_size=2, global_batch_size=8, dp_rank=r, dp_size=dp_size, seed=5, shuffle=False
            )
            for r in range(dp_size)
        ]
        return [torch.cat([torch.cat(it.next_microbatches()) for it in ranks]) for _ in range(len(train) // 8 + 2)]

    one = global_batches(1)
    torch.testing.assert_close(one[0], torch.from_numpy(train.get_samples(np.arange(8))))  # in Megatron's order
    for dp_size in (2, 4):
        for a, b in zip(one, global_batches(dp_size)):
            torch.testing.assert_close(a, b)


def test_train_reads_megatrons_samples_in_megatrons_order(tmp_path):
    from megatronapp.cli.main import build_parser
    from megatronapp.cli.run import build_train_run
    from megatronapp.cli.train import _build_data
    from megatronapp.parallel.groups import single_process_groups

    write_pair(tmp_path / "d", _documents(300, seed=12))
    flags = ["train", "--model", "tiny", "--data-path", str(tmp_path / "d"), "--split", "90,10,0"]
    args = build_parser().parse_args([*flags, "--global-batch-size", "8", "--train-iters", "50", "--seed", "9"])
    data = _build_data(build_train_run(args, 1), ByteTokenizer(), single_process_groups())
    config = DataConfig(data_path=(str(tmp_path / "d"),), split="90,10,0")
    train = build_datasets(config, seq_length=32, seed=9, num_samples=(400, None, None)).train
    for step in range(3):
        expected = torch.from_numpy(train.get_samples(np.arange(step * 8, step * 8 + 8)))
        torch.testing.assert_close(torch.cat(data.next_microbatches()), expected)


# --------------------------------------------------------------------------- blends and splits


def test_blend_draws_samples_in_the_stated_proportions(tmp_path):
    write_pair(tmp_path / "a", _documents(300, seed=3, low=0, high=100))  # A's ids < 100, B's >= 100
    write_pair(tmp_path / "b", _documents(300, seed=4, low=100, high=200))
    config = DataConfig(data_path=("0.3", str(tmp_path / "a"), "0.7", str(tmp_path / "b")), split="1")
    train = build_datasets(config, seq_length=8, seed=7, num_samples=(10_000, None, None)).train
    stream = DistributedBatchIterator(
        train, micro_batch_size=10, global_batch_size=100, dp_rank=0, dp_size=1, seed=7, shuffle=False
    )
    samples = torch.cat([torch.cat(stream.next_microbatches()) for _ in range(100)])  # 10k samples
    from_a = (samples < 100).all(dim=1).sum().item() / len(samples)
    from_b = (samples >= 100).all(dim=1).sum().item() / len(samples)
    assert abs(from_a - 0.3) <= 0.02 and abs(from_b - 0.7) <= 0.02 and from_a + from_b == 1.0
    # Megatron's weights are relative: 30 and 70 are the same blend
    same = DataConfig(data_path=("30", str(tmp_path / "a"), "70", str(tmp_path / "b")), split="1")
    again = build_datasets(same, seq_length=8, seed=7, num_samples=(10_000, None, None)).train
    np.testing.assert_array_equal(again.get_samples(np.arange(500)), train.get_samples(np.arange(500)))


@pytest.mark.parametrize("weights", [(0.3, 0.7), (0.5, 0.5), (0.2, 0.3, 0.1, 0.4), (1 / 3, 1 / 3, 1 / 3)])
def test_blending_indices_follow_megatrons_greedy_rule(weights):
    datasets, samples = compute_blending_indices(np.asarray(weights), 3000)
    expected_datasets, expected_samples = reference_blending(weights, 3000)
    assert datasets.tolist() == expected_datasets and samples.tolist() == expected_samples


def test_blending_indices_are_the_same_computed_chunk_by_chunk_in_any_order(monkeypatch):
    from megatronapp.data.blend import BlendingIndices

    expected_datasets, expected_samples = reference_blending((0.2, 0.3, 0.5), 500)
    monkeypatch.setattr(BlendingIndices, "CHUNK", 7)
    lazy = BlendingIndices(np.asarray((0.2, 0.3, 0.5)), 500)
    order = np.random.default_rng(0).permutation(500)
    datasets, samples = lazy.lookup(order[:250])
    rest_datasets, rest_samples = lazy.lookup(order[250:])
    assert np.concatenate((datasets, rest_datasets)).tolist() == [expected_datasets[i] for i in order]
    assert np.concatenate((samples, rest_samples)).tolist() == [expected_samples[i] for i in order]


def test_split_sample_counts_are_megatrons():
    assert compute_split_num_samples(1000, 32, eval_interval=100, eval_iters=10) == (32000, 11 * 10 * 32, 10 * 32)
    assert compute_split_num_samples(50, 8) == (400, 0, 0)


def test_split_98_1_1_gives_disjoint_documents(tmp_path):
    docs = [[i] * (1 + i % 5) for i in range(1000)]  # every token names its document
    write_pair(tmp_path / "d", docs, code=4)
    splits = build_datasets(DataConfig(data_path=(str(tmp_path / "d"),), split="98,1,1"), seq_length=4, seed=3)
    seen = [set(np.unique(s.get_samples(np.arange(len(s)))).tolist()) for s in splits]
    assert seen[0] | seen[1] | seen[2] == set(range(1000))
    assert not (seen[0] & seen[1]) and not (seen[0] & seen[2]) and not (seen[1] & seen[2])
    assert (len(seen[1]), len(seen[2])) == (10, 10)
    assert compute_split_bounds((0.969, 0.03, 0.001), 1000) == [0, 969, 999, 1000]
    assert compute_split_bounds((0.5, 0.25, 0.25), 7) == [0, 3, 5, 7]  # each rounded, the excess off every bound


def test_per_split_paths_build_each_split_from_whole_files(tmp_path):
    for name, seed in (("a", 5), ("b", 6)):
        write_pair(tmp_path / name, _documents(60, seed=seed))
    config = DataConfig(train_data_path=(str(tmp_path / "a"),), valid_data_path=(str(tmp_path / "b"),))
    splits = build_datasets(config, seq_length=8, seed=1)
    assert splits.test is None
    assert sorted(set(splits.train.document_index.tolist())) == list(range(60))
    assert splits.valid.indexed.prefix == str(tmp_path / "b")


# --------------------------------------------------------------------------- preprocess-data


def test_preprocess_output_reads_back_with_the_independent_reader_and_ours(tmp_path):
    texts = [f"document {i}: " + "word " * (i % 9) for i in range(700)] + [""]
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("\n".join(json.dumps({"text": t, "id": i}) for i, t in enumerate(texts)) + "\n\n")
    tok = ByteTokenizer()
    outputs = {}
    for workers in (1, 2):
        prefix = str(tmp_path / f"w{workers}" / "corpus")
        config = PreprocessConfig(str(corpus), prefix, append_eod=True, workers=workers)
        counts = preprocess_data(config, show_progress=False)
        assert counts == {"text": 700}  # the empty document is left out, as Megatron does
        outputs[workers] = config.output_prefixes()["text"]
    for prefix in outputs.values():
        sequences, documents = read_pair(prefix)
        assert documents == list(range(701))
        expected = [tok.encode(t) + [tok.eod_id] for t in texts[:700]]
        assert [s.tolist() for s in sequences] == expected and sequences[0].dtype == np.uint16
        ours = IndexedDataset(prefix)
        assert [ours.get(i).tolist() for i in range(len(ours))] == expected
    for suffix in (".bin", ".idx"):  # the worker count does not change the output
        assert open(outputs[1] + suffix, "rb").read() == open(outputs[2] + suffix, "rb").read()


def test_preprocess_with_a_tokenizer_json_and_with_megatrons_null_tokenizer(tmp_path):
    from test_data import _train_tiny_bpe

    from megatronapp.data.tokenizer import HFTokenizer
    from megatronapp.data.tokenizer_types import NullTokenizer, build_tokenizer

    texts = [f"the cat {i} sat on the mat" for i in range(100)]
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("\n".join(json.dumps({"text": t, "ids": f"{i} {i + 1} 7"}) for i, t in enumerate(texts)))
    tok_file = _train_tiny_bpe(tmp_path / "tokenizer.json", ["<unk>", "</s>"])
    hf = PreprocessConfig(str(corpus), str(tmp_path / "hf"), tokenizer_model=str(tok_file), append_eod=True, workers=2)
    preprocess_data(hf, show_progress=False)
    tok = HFTokenizer(tok_file)
    sequences, _ = read_pair(hf.output_prefixes()["text"])
    assert [s.tolist() for s in sequences] == [tok.encode(t) + [tok.eod_id] for t in texts]
    null = PreprocessConfig(
        str(corpus), str(tmp_path / "null"), json_keys=("ids",), tokenizer_type="NullTokenizer", vocab_size=500
    )
    preprocess_data(null, show_progress=False)
    sequences, _ = read_pair(null.output_prefixes()["ids"])
    assert [s.tolist() for s in sequences] == [[i, i + 1, 7] for i in range(100)]
    assert isinstance(build_tokenizer("NullTokenizer", vocab_size=500), NullTokenizer)
    assert (build_tokenizer("NullTokenizer", vocab_size=500).vocab_size, NullTokenizer(500).eod_id) == (501, 500)


def test_preprocess_bad_line_is_one_line_and_writes_nothing(tmp_path, capsys):
    from megatronapp.cli.main import main

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"body": "no text"}) + "\n")
    code = main(["preprocess-data", "--input", str(corpus), "--output-prefix", str(tmp_path / "out" / "c")])
    err = [line for line in capsys.readouterr().err.splitlines() if line]
    assert code == 2 and err == [f'megatronapp: error: {corpus}:2: expected a JSON object with a string "text" field']
    assert list((tmp_path / "out").iterdir()) == []


def test_preprocess_then_train_and_resume_on_another_layout(tmp_path, capsys):
    from megatronapp.cli.main import main

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("\n".join(json.dumps({"text": f"story {i}: the cat sat. " * (1 + i % 4)}) for i in range(300)))
    prefix = str(tmp_path / "data" / "corpus")
    assert main(["preprocess-data", "--input", str(corpus), "--output-prefix", prefix, "--append-eod"]) == 0
    assert f"--data-path {prefix}_text_document" in capsys.readouterr().out
    base = [sys.executable, "-m", "megatronapp.cli.main", "train", "--device", "cpu", "--model", "tiny"]
    base += ["--data-path", f"{prefix}_text_document", "--global-batch-size", "4", "--train-iters", "4"]
    base += ["--split", "90,5,5", "--eval-interval", "2", "--eval-iters", "2"]
    valid: dict[int, float] = {}

    def train(name: str, *args: str) -> list[float]:
        metrics = tmp_path / f"{name}.jsonl"
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        res = subprocess.run(
            [*base, "--metrics-file", str(metrics), *args], capture_output=True, text=True, timeout=240, env=env
        )
        assert res.returncode == 0, res.stderr
        rows = [json.loads(line) for line in metrics.read_text().splitlines()]
        assert "validation loss at iteration 2" in res.stdout or name == "rest"
        for r in rows:
            if "valid_loss" in r:  # the same iteration's validation in another run must agree
                torch.testing.assert_close(valid.setdefault(r["iteration"], r["valid_loss"]), r["valid_loss"])
        return [r["loss"] for r in rows if "loss" in r]

    whole = train("whole")
    assert sorted(valid) == [2, 4]  # at the interval and at the end, from the valid split
    first = train("first", "--nproc-per-node", "2", "--train-iters", "2", "--save", str(tmp_path / "ckpt"))
    rest = train("rest", "--load", str(tmp_path / "ckpt"))
    torch.testing.assert_close(first + rest, whole, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- refused before launch


def _broken_inputs(tmp_path) -> dict[str, tuple[list[str], str]]:
    good = str(tmp_path / "good")
    write_pair(good, _documents(200, seed=8, max_len=60))
    write_pair(tmp_path / "noidx", _documents(5))
    (tmp_path / "noidx.idx").unlink()
    write_pair(tmp_path / "magic", _documents(5))
    raw = (tmp_path / "magic.idx").read_bytes()
    (tmp_path / "magic.idx").write_bytes(b"NOTANIDX\x00" + raw[9:])
    write_pair(tmp_path / "short", _documents(50, seed=9))
    raw = (tmp_path / "short.bin").read_bytes()
    (tmp_path / "short.bin").write_bytes(raw[: len(raw) // 2])
    write_pair(tmp_path / "cut", _documents(50, seed=9))
    raw = (tmp_path / "cut.idx").read_bytes()
    (tmp_path / "cut.idx").write_bytes(raw[:-5])
    write_pair(tmp_path / "gpt2", [[50000, 3, 7]] * 100, code=4)
    (tmp_path / "story.txt").write_text("once upon a time")
    return {
        "text with a split": (["--data-path", str(tmp_path / "story.txt"), "--split", "9,1"], "is a text file"),
        "tokens past the vocabulary": (["--data-path", str(tmp_path / "gpt2")], "token id 50000 is outside"),
        "file name for a prefix": (["--data-path", good + ".bin"], f"by its prefix, {good}"),
        "missing idx": (["--data-path", str(tmp_path / "noidx")], "noidx.idx: file not found"),
        "wrong magic": (["--data-path", str(tmp_path / "magic")], "magic.idx: not a Megatron indexed-dataset index"),
        "truncated idx": (["--data-path", str(tmp_path / "cut")], "cut.idx: "),
        "truncated bin": (["--data-path", str(tmp_path / "short")], "short.bin: "),
        "negative weight": (["--data-path", "0.5", good, "-0.5", good], "weights must be finite and >= 0"),
        "zero weights": (["--data-path", "0", good, "0", good], "weights sum to 0"),
        "weight arity": (["--data-path", "0.5", good, "0.5"], "expected WEIGHT PREFIX pairs, got 3 values"),
        "split arity": (["--data-path", good, "--split", "90,5,3,2"], "(three numbers), got 4"),
        "split negative": (["--data-path", good, "--split", "99,-1,2"], "shares must be >= 0"),
        "no train share": (["--data-path", good, "--split", "0,1,1"], "the train share is 0"),
        "empty train split": (["--data-path", good, "--split", "1,400,400"], "the train split holds none"),
        "tokenizer type": (["--data-path", good, "--tokenizer-type", "GPT2BPETokenizer"], "is not supported"),
        "both paths": (["--data-path", good, "--train-data-path", good], "exclude each other"),
        "evaluation without a valid share": (
            ["--data-path", good, "--split", "100,0,0", "--eval-interval", "1"],
            "--eval-interval: the validation split holds no document (--split 100,0,0)",
        ),
        "evaluation without a valid path": (
            ["--train-data-path", good, "--eval-interval", "1"],
            "(--valid-data-path is not given)",
        ),
    }


def test_broken_data_is_refused_in_one_line_before_launch(tmp_path, train_before_launch):
    for name, (args, message) in _broken_inputs(tmp_path).items():
        code, err = train_before_launch(args)
        assert code == 2 and len(err) == 1 and message in err[0], (name, err)
        assert err[0].startswith("megatronapp: error: "), (name, err)


# --------------------------------------------------------------------------- parity


def train_on_indexed(rank: int, world: int, job, prefix: str) -> dict:
    """Train job on the indexed dataset's Megatron samples; losses, norms and first-step grads."""
    from engine_jobs import full_grads

    from megatronapp.engine.trainer import Trainer
    from megatronapp.parallel.groups import build_process_groups, single_process_groups

    groups = build_process_groups(job.layout, rank) if world > 1 else single_process_groups()
    t = job.train
    train = build_datasets(
        DataConfig(data_path=(prefix,), split="98,1,1"),
        seq_length=job.model.seq_length,
        seed=t.seed,
        num_samples=(t.train_iters * t.global_batch_size, None, None),
    ).train
    data = DistributedBatchIterator(
        train,
        micro_batch_size=t.micro_batch_size,
        global_batch_size=t.global_batch_size,
        dp_rank=groups.dp_rank,
        dp_size=job.layout.dp_size,
        seed=t.seed,
        shuffle=False,
    )
    trainer = Trainer(job, groups, torch.device("cpu"), data)
    losses, grads = [], None
    for step in range(t.train_iters):
        losses.append(trainer.train_step().loss)
        if step == 0:
            grads = full_grads(trainer) if groups.dp_rank == 0 else {}
    return {"losses": losses, "grads": grads}


def test_tp2_pp2_trains_the_same_batches_as_one_process(cluster, tmp_path):
    from engine_jobs import assemble_full_grads, make_job

    write_pair(tmp_path / "d", _documents(400, seed=10, high=250, max_len=70), code=4)
    prefix = str(tmp_path / "d")
    torch.set_num_threads(1)
    reference = train_on_indexed(0, 1, make_job(1, global_batch=8, micro_batch=2, iters=3), prefix)
    reports = cluster.run(train_on_indexed, 4, make_job(4, 2, 2, global_batch=8, micro_batch=2, iters=3), prefix)
    for rep in reports:
        torch.testing.assert_close(rep["losses"], reference["losses"], rtol=1e-5, atol=1e-6)
    assert abs(reference["losses"][-1] - reference["losses"][0]) > 1e-3
    ref = {k: v[0] for k, v in reference["grads"].items()}
    for key, g in assemble_full_grads(reports).items():
        torch.testing.assert_close(g, ref[key], rtol=1e-4, atol=1e-6, msg=lambda m: f"{key}: {m}")


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "the embedded corpus is prose"),
        ("1 2 3\n4 hello 5\n", "NullTokenizer reads whitespace-separated integer ids, found 'hello'"),
        ("1 2 3 700\n", "token id 700 is outside --vocab-size 500 (ids 0..499)"),
    ],
)
def test_null_tokenizer_text_that_is_not_ids_in_its_vocabulary_is_refused_before_launch(
    train_before_launch, tmp_path, content, message
):
    args = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "500", "--train-iters", "1"]
    if content is not None:
        (tmp_path / "ids.txt").write_text(content)
        args += ["--data-path", str(tmp_path / "ids.txt")]
    code, err = train_before_launch(args)
    assert code == 2 and len(err) == 1 and message in err[0], err


def test_null_tokenizer_text_of_ids_trains(tmp_path):
    from megatronapp.cli.main import main

    ids = tmp_path / "ids.txt"
    ids.write_text(" ".join(str(i % 500) for i in range(4000)))
    args = ["train", "--device", "cpu", "--model", "tiny", "--tokenizer-type", "NullTokenizer", "--vocab-size", "500"]
    assert main([*args, "--data-path", str(ids), "--train-iters", "2", "--seq-length", "32"]) == 0
