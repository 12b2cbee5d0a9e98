"""A deterministic synthetic corpus with structure a tiny GPT can learn in ~100 steps.

Each document mixes five kinds of segments, chosen so that both local statistics and
attention to earlier tokens pay off:

  story  sentences from a small grammar over a fixed lexicon (~200 words) with
         subject-verb and determiner-noun number agreement and verb-object selection
         ("These brave wolves chase the old king near the river."); each document has a
         small cast of nouns it keeps returning to.
  facts  a random key=value list ("facts: qxa=17, bzt=4.") that the document's closing
         "recall:" line repeats in a shuffled order: an induction / copy task.
  sums   small additions and subtractions ("12+7=19, 30-4=26.").
  count  arithmetic progressions ("count by 3: 2 5 8 11.").
  copy   a word list repeated after a bar ("copy: fox lamp red | fox lamp red.").

Only `random.Random(seed)` is used, with no set or dict iteration, so the text is the
same on every machine and Python hash seed.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import numpy as np

from megatronapp.data.tokenizer import Tokenizer, build_token_stream

NAMES = [
    "Anna",
    "Ben",
    "Carla",
    "Dan",
    "Eva",
    "Finn",
    "Gina",
    "Hugo",
    "Iris",
    "Jack",
    "Kara",
    "Leo",
    "Mia",
    "Nico",
    "Olga",
]
ANIMATES = [
    "cat",
    "dog",
    "bird",
    "fox",
    "horse",
    "mouse",
    "child",
    "teacher",
    "farmer",
    "doctor",
    "king",
    "queen",
    "girl",
    "boy",
    "wolf",
    "sheep",
    "rabbit",
    "duck",
    "baker",
    "sailor",
]
THINGS = [
    "ball",
    "box",
    "apple",
    "book",
    "cup",
    "key",
    "stone",
    "letter",
    "song",
    "tree",
    "house",
    "boat",
    "coin",
    "hat",
    "map",
    "lamp",
    "rope",
    "shell",
    "basket",
    "cake",
    "flower",
    "bell",
    "drum",
    "kite",
    "candle",
]
PLACES = [
    "garden",
    "forest",
    "market",
    "kitchen",
    "village",
    "castle",
    "school",
    "field",
    "harbor",
    "library",
    "river",
    "hill",
]
ADJECTIVES = [
    "red",
    "blue",
    "green",
    "small",
    "big",
    "old",
    "young",
    "happy",
    "quiet",
    "bright",
    "dark",
    "tall",
    "tiny",
    "heavy",
    "soft",
    "warm",
    "cold",
    "brave",
    "clever",
    "lazy",
    "busy",
    "strange",
    "gentle",
    "golden",
    "silver",
]
# Verbs split by what their object may be: a selection rule the model can pick up.
VERBS_ANIMATE_OBJ = [
    "see",
    "like",
    "follow",
    "help",
    "love",
    "chase",
    "visit",
    "watch",
    "meet",
    "call",
    "thank",
    "greet",
]
VERBS_THING_OBJ = [
    "carry",
    "hold",
    "push",
    "pull",
    "find",
    "want",
    "wash",
    "build",
    "paint",
    "read",
    "open",
    "throw",
    "bring",
    "fix",
    "hide",
    "need",
]
VERBS_INTRANSITIVE = ["sleep", "run", "sing", "dance", "wait", "laugh", "swim", "jump", "walk", "rest", "smile", "work"]
ADVERBS = [
    "quickly",
    "slowly",
    "quietly",
    "happily",
    "often",
    "never",
    "always",
    "sometimes",
    "loudly",
    "gladly",
    "carefully",
    "again",
]
PREPOSITIONS = ["in", "near", "behind", "inside", "outside", "beside"]
DETERMINERS_SINGULAR = ["the", "a", "this", "that", "every"]
DETERMINERS_PLURAL = ["the", "these", "those", "some", "many", "two", "three", "few"]
IRREGULAR_PLURALS = {"mouse": "mice", "child": "children", "wolf": "wolves", "sheep": "sheep"}
LETTERS = "abcdefghijklmnopqrstuvwxyz"


def _add_s(word: str) -> str:
    """English -s inflection, for noun plurals and third-person-singular verbs alike."""
    if word.endswith(("s", "x", "z", "ch", "sh")):
        return word + "es"
    if word.endswith("y") and word[-2] not in "aeiou":
        return word[:-1] + "ies"
    return word + "s"


def _plural(noun: str) -> str:
    return IRREGULAR_PLURALS.get(noun) or _add_s(noun)


def _verb_form(verb: str, plural_subject: bool) -> str:
    return verb if plural_subject else _add_s(verb)


def _noun_phrase(rng: random.Random, noun: str, plural: bool) -> str:
    head = _plural(noun) if plural else noun
    words = [rng.choice(DETERMINERS_PLURAL if plural else DETERMINERS_SINGULAR)]
    if rng.random() < 0.5:
        words.append(rng.choice(ADJECTIVES))
    words.append(head)
    if words[0] == "a" and words[1][0] in "aeiou":
        words[0] = "an"
    return " ".join(words)


def _subject(rng: random.Random, cast: list[str]) -> tuple[str, bool]:
    """A subject phrase and whether it is plural (names are singular, "X and Y" plural)."""
    roll = rng.random()
    if roll < 0.2:
        return rng.choice(NAMES), False
    if roll < 0.3:
        first = _noun_phrase(rng, _pick_animate(rng, cast), rng.random() < 0.5)
        return f"{first} and {rng.choice(NAMES)}", True
    plural = rng.random() < 0.5
    return _noun_phrase(rng, _pick_animate(rng, cast), plural), plural


def _pick_animate(rng: random.Random, cast: list[str]) -> str:
    # Documents keep returning to their cast, so earlier mentions predict later ones.
    return rng.choice(cast) if rng.random() < 0.7 else rng.choice(ANIMATES)


def _sentence(rng: random.Random, cast: list[str], props: list[str]) -> str:
    subject, plural = _subject(rng, cast)
    kind = rng.random()
    if kind < 0.35:
        verb = _verb_form(rng.choice(VERBS_ANIMATE_OBJ), plural)
        rest = _noun_phrase(rng, _pick_animate(rng, cast), rng.random() < 0.4)
        if rng.random() < 0.3:
            rest = rng.choice(NAMES)
    elif kind < 0.7:
        verb = _verb_form(rng.choice(VERBS_THING_OBJ), plural)
        thing = rng.choice(props) if rng.random() < 0.7 else rng.choice(THINGS)
        rest = _noun_phrase(rng, thing, rng.random() < 0.4)
    else:
        verb = _verb_form(rng.choice(VERBS_INTRANSITIVE), plural)
        rest = rng.choice(ADVERBS)
    if rng.random() < 0.35:
        rest += f" {rng.choice(PREPOSITIONS)} the {rng.choice(PLACES)}"
    text = f"{subject} {verb} {rest}."
    return text[0].upper() + text[1:]


def _story(rng: random.Random, cast: list[str], props: list[str]) -> str:
    return " ".join(_sentence(rng, cast, props) for _ in range(rng.randint(2, 5)))


def _facts(rng: random.Random) -> list[tuple[str, int]]:
    num_keys = rng.randint(2, 5)
    keys: list[str] = []
    while len(keys) < num_keys:
        key = "".join(rng.choice(LETTERS) for _ in range(3))
        if key not in keys:
            keys.append(key)
    return [(k, rng.randrange(100)) for k in keys]


def _format_pairs(pairs: list[tuple[str, int]]) -> str:
    return ", ".join(f"{k}={v}" for k, v in pairs)


def _sums(rng: random.Random) -> str:
    items = []
    for _ in range(rng.randint(2, 4)):
        a, b = rng.randrange(50), rng.randrange(50)
        if rng.random() < 0.5:
            items.append(f"{a}+{b}={a + b}")
        else:
            a, b = max(a, b), min(a, b)
            items.append(f"{a}-{b}={a - b}")
    return "sums: " + ", ".join(items) + "."


def _count(rng: random.Random) -> str:
    start, step, n = rng.randrange(40), rng.randint(1, 4), rng.randint(4, 8)
    numbers = " ".join(str(start + i * step) for i in range(n))
    label = "count" if step == 1 else f"count by {step}"
    return f"{label}: {numbers}."


def _copy(rng: random.Random) -> str:
    pool = ANIMATES + THINGS + ADJECTIVES
    words = " ".join(rng.choice(pool) for _ in range(rng.randint(3, 6)))
    return f"copy: {words} | {words}."


def generate_synthetic_document(rng: random.Random) -> str:
    """One document (a few hundred characters, one segment per line) drawn from `rng`."""
    cast = rng.sample(ANIMATES, 2)
    props = rng.sample(THINGS, 2)
    facts = _facts(rng) if rng.random() < 0.6 else []
    lines = [f"facts: {_format_pairs(facts)}."] if facts else []
    for _ in range(rng.randint(2, 5)):
        roll = rng.random()
        if roll < 0.55:
            lines.append(_story(rng, cast, props))
        elif roll < 0.7:
            lines.append(_sums(rng))
        elif roll < 0.85:
            lines.append(_count(rng))
        else:
            lines.append(_copy(rng))
    if facts:
        recalled = facts[:]
        rng.shuffle(recalled)
        lines.append(f"recall: {_format_pairs(recalled)}.")
    return "\n".join(lines)


def iter_synthetic_documents(seed: int) -> Iterator[str]:
    """Endless stream of documents; the first n equal generate_synthetic_corpus(n, seed)."""
    rng = random.Random(seed)
    while True:
        yield generate_synthetic_document(rng)


def generate_synthetic_corpus(num_documents: int, seed: int) -> list[str]:
    """`num_documents` synthetic documents, identical for the same seed on every machine."""
    if num_documents < 0:
        raise ValueError(f"num_documents must be >= 0, got {num_documents}")
    docs = iter_synthetic_documents(seed)
    return [next(docs) for _ in range(num_documents)]


def default_corpus_tokens(tokenizer: Tokenizer, num_tokens: int, seed: int) -> np.ndarray:
    """Exactly `num_tokens` ids of the synthetic corpus, documents separated by EOD.

    A prefix of the stream does not depend on `num_tokens`, so asking for more tokens only
    appends. dtype is uint16 for vocabularies up to 65536, else int32.
    """
    if num_tokens < 1:
        raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
    return build_token_stream(tokenizer, iter_synthetic_documents(seed), max_tokens=num_tokens)
