"""Data layer: tokenizers, synthetic corpus, file loading, datasets and the DP batch iterator."""

from __future__ import annotations

import hashlib
import math
import os
import re
import subprocess
import sys
import time
from collections import Counter

import numpy as np
import pytest
import torch

from megatronapp.data.dataset import (
    DistributedBatchIterator,
    GPTDataset,
    build_default_dataset,
    build_text_dataset,
    build_token_stream,
    compute_epoch_permutation,
    load_text_documents,
)
from megatronapp.data.synthetic import (
    ADJECTIVES,
    ANIMATES,
    NAMES,
    THINGS,
    VERBS_ANIMATE_OBJ,
    VERBS_INTRANSITIVE,
    VERBS_THING_OBJ,
    default_corpus_tokens,
    generate_synthetic_corpus,
)
from megatronapp.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer

# --------------------------------------------------------------------------- tokenizers


def _train_tiny_bpe(path, special_tokens):
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = RawTokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=special_tokens, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(generate_synthetic_corpus(50, seed=0), trainer)
    tok.save(str(path))
    return path


@pytest.fixture(scope="module")
def bpe_with_eos(tmp_path_factory):
    return _train_tiny_bpe(tmp_path_factory.mktemp("eos") / "tokenizer.json", ["<unk>", "<pad>", "</s>"])


@pytest.fixture(scope="module")
def bpe_without_eos(tmp_path_factory):
    return _train_tiny_bpe(tmp_path_factory.mktemp("noeos") / "tokenizer.json", ["<unk>"])


def test_byte_tokenizer_round_trips_unicode_and_reserves_eod():
    tok = ByteTokenizer()
    text = "héllo wörld ✓ 12+7=19"
    ids = tok.encode(text)
    assert (tok.vocab_size, tok.eod_id) == (257, 256)
    assert all(0 <= i < 256 for i in ids) and len(ids) == len(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert tok.decode(tok.encode("ab") + [tok.eod_id] + tok.encode("cd")) == "abcd"


def test_byte_tokenizer_decode_never_raises_on_bad_input():
    tok = ByteTokenizer()
    assert tok.decode([0xFF, 0xFE, ord("a")]) == "\ufffd\ufffda"
    cut = tok.encode("✓")[:2]  # a truncated multi-byte character
    assert tok.decode(cut + [ord("x")]).endswith("x") and "\ufffd" in tok.decode(cut)
    assert tok.decode([ord("a"), 300, -1, ord("b")]) == "a\ufffd\ufffdb"  # padded-vocab ids


def test_tokenizers_satisfy_protocol(bpe_with_eos):
    assert isinstance(ByteTokenizer(), Tokenizer)
    assert isinstance(HFTokenizer(bpe_with_eos), Tokenizer)


def test_hf_tokenizer_uses_named_eos_token(bpe_with_eos):
    from tokenizers import Tokenizer as RawTokenizer

    raw = RawTokenizer.from_file(str(bpe_with_eos))
    tok = HFTokenizer(bpe_with_eos)
    assert tok.eod_id == raw.token_to_id("</s>")
    assert tok.vocab_size == raw.get_vocab_size()
    text = "The cat sees Anna near the river."
    ids = tok.encode(text)
    assert tok.eod_id not in ids and len(ids) < len(text)  # BPE merged something
    assert tok.decode(ids) == text
    assert tok.decode(ids + [tok.eod_id, tok.vocab_size + 5]) == text


def test_hf_tokenizer_without_eos_appends_one_id(bpe_without_eos):
    from tokenizers import Tokenizer as RawTokenizer

    base = RawTokenizer.from_file(str(bpe_without_eos)).get_vocab_size()
    tok = HFTokenizer(bpe_without_eos)
    assert (tok.eod_id, tok.vocab_size) == (base, base + 1)
    assert tok.decode(tok.encode("two cats") + [tok.eod_id]) == "two cats"
    explicit = HFTokenizer(bpe_without_eos, eod_id=0)
    assert (explicit.eod_id, explicit.vocab_size) == (0, base)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        HFTokenizer(bpe_without_eos, eod_id=base + 1)


def test_load_tokenizer_picks_implementation_and_accepts_folder(bpe_with_eos):
    assert isinstance(load_tokenizer(None), ByteTokenizer)
    from_folder = load_tokenizer(bpe_with_eos.parent)
    assert isinstance(from_folder, HFTokenizer) and from_folder.path == bpe_with_eos
    with pytest.raises(ValueError, match="eod_id"):
        load_tokenizer(None, eod_id=3)


def test_hf_tokenizer_missing_or_malformed_file_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.json"):
        load_tokenizer(tmp_path / "nope.json")
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        load_tokenizer(tmp_path)  # folder without a tokenizer.json
    bad = tmp_path / "bad.json"
    bad.write_text('{"model": ')
    with pytest.raises(ValueError, match="bad.json is not a valid tokenizer.json"):
        load_tokenizer(bad)
    wrong_schema = tmp_path / "schema.json"
    wrong_schema.write_text('{"hello": 1}')
    with pytest.raises(ValueError, match="schema.json"):
        load_tokenizer(wrong_schema)


# --------------------------------------------------------------------------- token stream


def test_build_token_stream_puts_eod_after_each_document_and_skips_empty():
    tok = ByteTokenizer()
    stream = build_token_stream(tok, ["ab", "", "c"])
    assert stream.dtype == np.uint16
    assert stream.tolist() == [97, 98, 256, 99, 256]
    capped = build_token_stream(tok, iter(["abc", "def", "ghi"]), max_tokens=5)
    assert capped.tolist() == [97, 98, 99, 256, 100]


def test_build_token_stream_widens_dtype_for_large_vocab():
    class BigVocab:
        vocab_size, eod_id = 70_000, 69_999

        def encode(self, text):
            return [69_000 + len(text)]

        def decode(self, ids):
            return ""

    stream = build_token_stream(BigVocab(), ["abc"])
    assert stream.dtype == np.int32 and stream.tolist() == [69_003, 69_999]


# --------------------------------------------------------------------------- synthetic corpus


def _corpus_digest(num_documents, seed):
    return hashlib.sha256("\x00".join(generate_synthetic_corpus(num_documents, seed)).encode()).hexdigest()


def test_synthetic_corpus_is_deterministic_across_processes_and_hash_seeds():
    assert generate_synthetic_corpus(20, 7) == generate_synthetic_corpus(20, 7)
    assert generate_synthetic_corpus(20, 7) != generate_synthetic_corpus(20, 8)
    assert generate_synthetic_corpus(30, 7)[:20] == generate_synthetic_corpus(20, 7)
    code = (
        "import hashlib; from megatronapp.data.synthetic import generate_synthetic_corpus as g; "
        "print(hashlib.sha256(chr(0).join(g(40, 5)).encode()).hexdigest())"
    )
    for hash_seed in ("1", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True, timeout=60
        )
        assert out.stdout.strip() == _corpus_digest(40, 5)


def _lines_with(prefix, docs):
    return [line for doc in docs for line in doc.split("\n") if line.startswith(prefix)]


def test_synthetic_recall_repeats_the_documents_facts():
    docs = generate_synthetic_corpus(300, 1)
    checked = 0
    for doc in docs:
        facts = re.findall(r"^facts: (.*)\.$", doc, re.M)
        recall = re.findall(r"^recall: (.*)\.$", doc, re.M)
        assert len(facts) == len(recall) <= 1
        if facts:
            assert sorted(facts[0].split(", ")) == sorted(recall[0].split(", "))
            assert doc.index("facts:") < doc.index("recall:")
            checked += 1
    assert checked > 100


def test_synthetic_arithmetic_counting_and_copy_lines_are_correct():
    docs = generate_synthetic_corpus(300, 2)
    sums = [item for line in _lines_with("sums: ", docs) for item in line[6:-1].split(", ")]
    for item in sums:
        a, op, b, c = re.fullmatch(r"(\d+)([+-])(\d+)=(\d+)", item).groups()
        assert int(c) == (int(a) + int(b) if op == "+" else int(a) - int(b))
    counts = _lines_with("count", docs)
    for line in counts:
        numbers = [int(x) for x in line.split(": ")[1][:-1].split()]
        step = int(line.split()[2][:-1]) if line.startswith("count by") else 1
        assert np.all(np.diff(numbers) == step)
    copies = _lines_with("copy: ", docs)
    for line in copies:
        left, right = line[6:-1].split(" | ")
        assert left == right
    assert len(sums) > 50 and len(counts) > 20 and len(copies) > 20


def _third_person(verb):
    if verb.endswith(("s", "x", "ch", "sh")):
        return verb + "es"
    return verb[:-1] + "ies" if verb.endswith("y") and verb[-2] not in "aeiou" else verb + "s"


def _story_sentences(docs):
    return [s.split() for doc in docs for s in re.findall(r"[A-Z][A-Za-z ]+\.", doc)]


def test_synthetic_grammar_agrees_in_number():
    sentences = _story_sentences(generate_synthetic_corpus(300, 3))
    base = set(VERBS_ANIMATE_OBJ + VERBS_THING_OBJ + VERBS_INTRANSITIVE)
    third = {_third_person(v) for v in base}
    name_subject = [w for w in sentences if w[0] in NAMES and w[1] != "and"]
    joint_subject = [w for w in sentences if "and" in w]
    for words in name_subject:  # "Anna sees ...": singular verb
        assert words[1] in third, words
    for words in joint_subject:  # "The cat and Ben see ...": base verb right after the name
        assert words[words.index("and") + 2] in base, words
    singular_nouns = set(ANIMATES + THINGS) - {"sheep"}
    checked = Counter()
    for words in sentences:
        for i, word in enumerate(words[:-1]):
            head = words[i + 2] if words[i + 1] in ADJECTIVES else words[i + 1]
            head = head.rstrip(".")
            if word.lower() in ("these", "those", "two", "three", "many", "few", "some"):
                assert head not in singular_nouns, words
                checked["plural"] += 1
            elif word.lower() in ("a", "an", "this", "that", "every"):
                assert head in singular_nouns | {"sheep"}, words
                if word.lower() in ("a", "an"):
                    assert (word.lower() == "an") == (words[i + 1][0] in "aeiou"), words
                checked["singular"] += 1
    assert len(name_subject) > 100 and len(joint_subject) > 20 and min(checked.values()) > 200


def test_synthetic_lexicon_size_is_about_two_hundred_words():
    lexicon = Counter(
        w.lower().rstrip(".") for words in _story_sentences(generate_synthetic_corpus(500, 4)) for w in words
    )
    assert 150 <= len(lexicon) <= 450  # inflected forms included
    assert lexicon.most_common(1)[0][0] == "the"


def _order2_byte_entropy_bits(train, test):
    """Held-out cross-entropy of an add-alpha byte model conditioned on the two previous ids."""

    def contexts(x):
        return (x[:-2] * 257 + x[1:-1]).tolist()

    pairs = Counter(zip(contexts(train), train[2:].tolist()))
    ctx_counts = Counter(contexts(train))
    alpha = 0.01
    total = sum(
        -math.log2((pairs.get((c, t), 0) + alpha) / (ctx_counts.get(c, 0) + alpha * 257))
        for c, t in zip(contexts(test), test[2:].tolist())
    )
    return total / (len(test) - 2)


def test_synthetic_corpus_is_learnable_by_a_short_context_model():
    tokens = default_corpus_tokens(ByteTokenizer(), 120_000, seed=9).astype(np.int64)
    bits = _order2_byte_entropy_bits(tokens[:100_000], tokens[100_000:])
    assert bits < 3.0  # vs log2(257) ~ 8 for noise: a tiny GPT has plenty to learn fast


def test_default_corpus_tokens_shape_prefix_and_speed():
    tok = ByteTokenizer()
    start = time.process_time()  # CPU time: other jobs on a shared CI machine must not fail this
    big = default_corpus_tokens(tok, 2_000_000, seed=11)
    elapsed = time.process_time() - start
    assert big.shape == (2_000_000,) and big.dtype == np.uint16
    assert elapsed < 2.0, f"2M tokens took {elapsed:.2f}s"
    small = default_corpus_tokens(tok, 5_000, seed=11)
    assert np.array_equal(small, big[:5_000])
    assert (big == tok.eod_id).sum() > 1_000 and big.max() == tok.eod_id
    assert not np.array_equal(small, default_corpus_tokens(tok, 5_000, seed=12))
    with pytest.raises(ValueError, match="num_tokens"):
        default_corpus_tokens(tok, 0, seed=1)


# --------------------------------------------------------------------------- file loading


def test_load_text_documents_reads_txt_jsonl_and_folders(tmp_path):
    (tmp_path / "b.txt").write_text("para one\n\npara two\n")
    (tmp_path / "a.jsonl").write_text('{"text": "first"}\n\n{"text": "second", "id": 2}\n{"text": "  "}\n')
    (tmp_path / "notes.md").write_text("ignored in folders")
    docs = load_text_documents(tmp_path)
    assert docs == ["first", "second", "para one\n\npara two\n"]  # sorted names; txt kept whole
    assert load_text_documents(str(tmp_path / "b.txt")) == ["para one\n\npara two\n"]
    assert load_text_documents([tmp_path / "b.txt", tmp_path / "a.jsonl"])[0].startswith("para")


@pytest.mark.parametrize(
    "line, message",
    [
        ("{not json}", "invalid JSON"),
        ('{"txt": "typo"}', 'string "text" field'),
        ('{"text": 5}', 'string "text" field'),
        ('["text"]', 'string "text" field'),
    ],
)
def test_load_text_documents_names_file_and_line_of_bad_jsonl(tmp_path, line, message):
    path = tmp_path / "data.jsonl"
    path.write_text('{"text": "ok"}\n\n' + line + "\n")
    with pytest.raises(ValueError, match=re.escape(f"{path}:3: ") + ".*" + re.escape(message)):
        load_text_documents(path)


def test_load_text_documents_rejects_missing_unsupported_and_non_utf8(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.txt"):
        load_text_documents(tmp_path / "missing.txt")
    (tmp_path / "data.csv").write_text("a,b")
    with pytest.raises(ValueError, match="unsupported data file type '.csv'"):
        load_text_documents(tmp_path / "data.csv")
    (tmp_path / "latin.txt").write_bytes(b"caf\xe9")
    with pytest.raises(ValueError, match="latin.txt: not valid UTF-8"):
        load_text_documents(tmp_path / "latin.txt")
    (tmp_path / "latin.jsonl").write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(ValueError, match="latin.jsonl:2: not valid UTF-8"):
        load_text_documents(tmp_path / "latin.jsonl")


def test_build_text_dataset_tokenizes_files(tmp_path):
    (tmp_path / "d.jsonl").write_text('{"text": "abcdef"}\n{"text": "ghij"}\n')
    ds = build_text_dataset(ByteTokenizer(), tmp_path / "d.jsonl", seq_length=4)
    assert ds.tokens.tolist() == list(b"abcdef") + [256] + list(b"ghij") + [256]
    (tmp_path / "empty.txt").write_text("\n\n")
    with pytest.raises(ValueError, match="no non-empty documents"):
        build_text_dataset(ByteTokenizer(), tmp_path / "empty.txt", seq_length=4)


# --------------------------------------------------------------------------- GPTDataset


def test_gpt_dataset_samples_are_strided_windows():
    tokens = np.arange(23, dtype=np.uint16)
    ds = GPTDataset(tokens, seq_length=5)
    assert len(ds) == 4  # (23 - 1) // 5
    for i in range(len(ds)):
        assert ds[i].tolist() == list(range(5 * i, 5 * i + 6))
    assert ds[-1].tolist() == ds[3].tolist()
    assert ds[1][0] == ds[0][-1]  # shared boundary: last input of one is first of the next
    stacked = ds.get_samples(np.array([3, 0, 3]))
    assert stacked.dtype == np.int64 and stacked.tolist() == [ds[3].tolist(), ds[0].tolist(), ds[3].tolist()]
    with pytest.raises(IndexError):
        ds[4]
    with pytest.raises(IndexError):
        ds.get_samples(np.array([4]))


def test_gpt_dataset_rejects_too_short_streams():
    assert len(GPTDataset(np.arange(6), seq_length=5)) == 1
    with pytest.raises(ValueError, match="fewer than one sample"):
        GPTDataset(np.arange(5), seq_length=5)
    with pytest.raises(ValueError, match="1-D"):
        GPTDataset(np.zeros((4, 4)), seq_length=2)


# --------------------------------------------------------------------------- batch iterator


def _dataset(num_samples=13, seq_length=4):
    return GPTDataset(np.arange(num_samples * seq_length + 1, dtype=np.int64) % 1000, seq_length)


def _iterator(ds, dp_rank=0, dp_size=1, micro=2, global_batch=8, seed=3):
    return DistributedBatchIterator(
        ds,
        micro_batch_size=micro,
        global_batch_size=global_batch,
        dp_rank=dp_rank,
        dp_size=dp_size,
        seed=seed,
    )


def _sample_ids(microbatches, seq_length):
    return [int(row[0]) // seq_length for mb in microbatches for row in mb]


def test_iterator_yields_long_microbatches_of_the_right_shape():
    ds = _dataset()
    it = _iterator(ds, dp_rank=1, dp_size=2, micro=2, global_batch=8)
    mbs = it.next_microbatches()
    assert it.num_microbatches == 2 and len(mbs) == 2
    for mb in mbs:
        assert mb.dtype == torch.long and mb.shape == (2, ds.seq_length + 1)
        for row in mb:  # each row is a real sample of the dataset
            assert row.tolist() == ds[int(row[0]) // ds.seq_length].tolist()
    assert it.state_dict()["consumed_samples"] == 8


@pytest.mark.parametrize("dp_size, micro", [(2, 1), (2, 2), (4, 1), (4, 2)])
def test_union_over_dp_ranks_equals_single_process_batches(dp_size, micro):
    ds = _dataset(num_samples=13)
    single = _iterator(ds, dp_size=1, micro=micro)
    ranks = [_iterator(ds, dp_rank=r, dp_size=dp_size, micro=micro) for r in range(dp_size)]
    for _ in range(5):  # 40 samples: crosses three epoch boundaries of 13
        reference = _sample_ids(single.next_microbatches(), ds.seq_length)
        parallel = [i for it in ranks for i in _sample_ids(it.next_microbatches(), ds.seq_length)]
        assert parallel == reference  # same samples in the same order, rank by rank


@pytest.mark.parametrize("split", [(3, 1), (1, 3), (2, 2)])
def test_an_uneven_split_over_dp_ranks_keeps_the_single_process_batch(split):
    ds = _dataset(num_samples=13)
    single = _iterator(ds, dp_size=1, micro=2)
    ranks = [_iterator(ds, dp_rank=r, dp_size=2, micro=2) for r in range(2)]
    for _ in range(3):
        reference = _sample_ids(single.next_microbatches(), ds.seq_length)
        mine = [it.next_microbatches(split) for it in ranks]
        assert [len(m) for m in mine] == list(split)
        assert [i for m in mine for i in _sample_ids(m, ds.seq_length)] == reference


def test_each_epoch_visits_every_sample_once_in_a_seeded_order():
    ds = _dataset(num_samples=16)
    it = _iterator(ds, global_batch=8)
    epochs = [_sample_ids(it.next_microbatches() + it.next_microbatches(), ds.seq_length) for _ in range(3)]
    for order in epochs:
        assert sorted(order) == list(range(16))
    assert epochs[0] != epochs[1] != epochs[2]
    assert epochs[1] == compute_epoch_permutation(16, 3, 1).tolist()
    other_seed = _iterator(ds, global_batch=8, seed=4)
    assert _sample_ids(other_seed.next_microbatches(), 4) != epochs[0][:8]


@pytest.mark.parametrize("resume_dp_size", [1, 2])
def test_state_dict_resumes_the_exact_batch_sequence(resume_dp_size):
    ds = _dataset(num_samples=13)
    first = _iterator(ds)
    batches = [first.next_microbatches() for _ in range(5)]
    replay = _iterator(ds)
    replay.next_microbatches()
    replay.next_microbatches()
    state = replay.state_dict()
    assert state["consumed_samples"] == 16
    resumed = [_iterator(ds, dp_rank=r, dp_size=resume_dp_size) for r in range(resume_dp_size)]
    for it in resumed:
        it.load_state_dict(state)
    for expected in batches[2:]:
        got = [mb for it in resumed for mb in it.next_microbatches()]
        assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))


def test_load_state_dict_rejects_a_different_seed_or_dataset():
    ds = _dataset(num_samples=13)
    state = _iterator(ds, seed=3).state_dict()
    with pytest.raises(ValueError, match="seed=3"):
        _iterator(ds, seed=5).load_state_dict(state)
    with pytest.raises(ValueError, match="num_samples=13"):
        _iterator(_dataset(num_samples=14), seed=3).load_state_dict(state)
    with pytest.raises(ValueError, match="consumed_samples"):
        _iterator(ds).load_state_dict({"consumed_samples": -8})


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(micro=3, global_batch=8), "not divisible by micro batch size 3"),
        (dict(dp_size=3, global_batch=8), "data-parallel size 3"),
        (dict(dp_rank=2, dp_size=2), "dp_rank 2 is outside 0..1"),
        (dict(micro=0), "micro_batch_size must be >= 1"),
        (dict(seed=-1), "seed must be >= 0"),
    ],
)
def test_iterator_rejects_bad_configuration(kwargs, message):
    with pytest.raises(ValueError, match=message):
        _iterator(_dataset(), **kwargs)


def test_build_default_dataset_trains_on_synthetic_tokens():
    tok = ByteTokenizer()
    ds = build_default_dataset(tok, seq_length=32, seed=1, num_tokens=10_000)
    assert len(ds) == (10_000 - 1) // 32
    assert np.array_equal(ds.tokens, default_corpus_tokens(tok, 10_000, seed=1))
    it = _iterator(ds, micro=4, global_batch=16)
    text = tok.decode(it.next_microbatches()[0][0].tolist())
    assert re.search(r"[a-z]+ [a-z]+", text)
