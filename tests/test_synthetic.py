"""Tests for the procedural generators: determinism, split disjointness, answers, scores,
and all examples tokenized at once (``Generator.documents``)."""

import collections
import re

import numpy as np
import pytest

import flaxformer_lite.data.generator as base
import flaxformer_lite.data.synthetic as syn
from flaxformer_lite.data.byte_texts import ByteTexts, stable_hash
from flaxformer_lite.data.documents import LABELLED_RECORDS, PAIR_RECORDS, TEXT_RECORDS
from flaxformer_lite.data.sentiment_words import (
    LABELS,
    NEGATIONS,
    NEGATIVE_WORDS,
    NEUTRAL_WORDS,
    POSITIVE_WORDS,
)
from flaxformer_lite.data.tokenizers import ByteTokenizer, make_tokenizer

NAMES = sorted(syn.GENERATORS)


def _key(generator, record):
    """The input a record is judged on: what must never cross from validation into train."""
    if generator.records == TEXT_RECORDS:
        return base.split_prompt(record["text"])[0]
    if generator.records == PAIR_RECORDS:
        return record["source"]
    return record["text"]


def _reference(generator, record):
    if generator.records == TEXT_RECORDS:
        return base.split_prompt(record["text"])[1]
    if generator.records == PAIR_RECORDS:
        return record["target"]
    return record["label"]


# An independent reading of English number words, to check number_to_words without reusing it.
_UNITS = re.findall(
    r"\w+",
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen "
    "fifteen sixteen seventeen eighteen nineteen",
)
_VALUES = {word: i for i, word in enumerate(_UNITS)}
_TEN_WORDS = re.findall(r"\w+", "twenty thirty forty fifty sixty seventy eighty ninety")
_VALUES |= {word: 10 * i for i, word in enumerate(_TEN_WORDS, start=2)}
_SCALES = {"thousand": 1_000, "million": 1_000_000}


def parse_number_words(text):
    total = current = 0
    for word in text.replace("-", " ").split():
        if word == "hundred":
            current *= 100
        elif word in _SCALES:
            total, current = total + current * _SCALES[word], 0
        else:
            current += _VALUES[word]
    return total + current


# Tens followed by a unit must be hyphenated ("forty-two"), never "forty two".
_UNHYPHENATED = re.compile(rf"\b({'|'.join(_TEN_WORDS)}) ({'|'.join(_UNITS[1:10])})\b")


@pytest.mark.parametrize("name", NAMES)
def test_examples_are_pure_functions_of_seed_split_and_index(name):
    forward = syn.make_generator(name, seed=3)
    ahead = [forward[i] for i in range(200)]
    backward = syn.make_generator(name, seed=3)
    behind = [backward.example(i) for i in reversed(range(200))][::-1]
    assert ahead == behind
    assert syn.make_generator(name, seed=3, size=150)[137] == ahead[137]  # size does not reshuffle
    assert syn.make_generator(name, seed=3)[np.int64(42)] == ahead[42]

    other_seed = [syn.make_generator(name, seed=4)[i] for i in range(200)]
    other_split = [syn.make_generator(name, seed=3, split="validation")[i] for i in range(200)]
    assert sum(a != b for a, b in zip(ahead, other_seed, strict=True)) > 150
    assert sum(a != b for a, b in zip(ahead, other_split, strict=True)) > 150


@pytest.mark.parametrize(
    ("name", "options"),
    [(name, {}) for name in NAMES]
    + [("arithmetic", {"max_digits": 1}), ("number_words", {"max_value": 99})],
)
def test_validation_inputs_never_appear_in_train(name, options):
    train = [syn.make_generator(name, seed=s, size=1500, **options) for s in (0, 1)]
    valid = [
        syn.make_generator(name, seed=s, split="validation", size=500, **options) for s in (0, 7)
    ]
    train_keys = {_key(t, t[i]) for t in train for i in range(len(t))}
    valid_keys = {_key(t, t[i]) for t in valid for i in range(len(t))}
    assert not train_keys & valid_keys
    assert {base.split_of(k) for k in valid_keys} == {"validation"}
    assert len(valid_keys) >= 5  # even the small domains keep a usable validation set


def test_hash_partition_sends_about_the_validation_fraction():
    keys = [f"{i}+{i * 7}=" for i in range(20_000)]
    share = sum(base.split_of(k) == "validation" for k in keys) / len(keys)
    assert abs(share - base.VALIDATION_FRACTION) < 0.01


def test_records_hold_the_documented_keys():
    expected = {
        "lm": {"text": str},
        "seq2seq": {"source": str, "target": str},
        "classification": {"text": str, "label": int},
    }
    for name in NAMES:
        generator = syn.make_generator(name)
        for i in range(20):
            record = generator[i]
            assert {k: type(v) for k, v in record.items()} == expected[generator.records], name


def test_arithmetic_answers_are_correct():
    plain = dict(fixed_width=False, reverse_answer=False)
    generator = syn.make_generator("arithmetic", max_digits=5, size=3000, **plain)
    ops, lengths = collections.Counter(), collections.Counter()
    for i in range(len(generator)):
        a, op, b, answer = re.fullmatch(r"(\d+)([+-])(\d+)=(\d+)", generator[i]["text"]).groups()
        assert int(answer) == (int(a) + int(b) if op == "+" else int(a) - int(b))
        for operand in (a, b, answer):
            assert operand == str(int(operand))  # no leading zeros
        ops[op] += 1
        lengths.update([len(a), len(b)])
    # Operand lengths are uniform over 1..max_digits (3 sigma), so short problems are not rare.
    assert sorted(lengths) == [1, 2, 3, 4, 5]
    assert all(abs(count / lengths.total() - 1 / 5) < 0.015 for count in lengths.values())
    assert min(ops["+"], ops["-"]) > 1000
    no_sub = syn.make_generator("arithmetic", subtraction=False)
    assert all("-" not in no_sub[i]["text"] for i in range(300))


def test_arithmetic_writes_zero_padded_reversed_answers_by_default():
    generator = syn.make_generator("arithmetic", size=3000)
    texts = [generator[i]["text"] for i in range(len(generator))]
    assert all(re.fullmatch(r"\d{3}[+-]\d{3}=\d{4}", text) for text in texts)
    prompt, answer = base.split_prompt(texts[0])
    a, op, b = int(prompt[:3]), prompt[3], int(prompt[4:7])
    assert int(answer[::-1]) == (a + b if op == "+" else a - b)


@pytest.mark.parametrize(
    ("fixed_width", "reverse_answer"), [(True, True), (True, False), (False, True)]
)
def test_arithmetic_fixed_width_and_reversed_answers_are_correct(fixed_width, reverse_answer):
    options = dict(max_digits=3, fixed_width=fixed_width, reverse_answer=reverse_answer)
    generator = syn.make_generator("arithmetic", size=2000, **options)
    plain = syn.make_generator("arithmetic", size=2000, max_digits=3, fixed_width=False)
    for i in range(len(generator)):
        a, op, b, answer = re.fullmatch(r"(\d+)([+-])(\d+)=(\d+)", generator[i]["text"]).groups()
        written = answer[::-1] if reverse_answer else answer
        assert int(written) == (int(a) + int(b) if op == "+" else int(a) - int(b))
        if fixed_width:
            assert (len(a), len(b), len(answer)) == (3, 3, 4)
        else:
            assert written == str(int(written))
    # The same problems as the plain format, in the same order, when only the answer is reversed.
    if not fixed_width:
        assert [base.split_prompt(generator[i]["text"])[0] for i in range(50)] == [
            base.split_prompt(plain[i]["text"])[0] for i in range(50)
        ]


def test_reverse_answers_are_correct():
    generator = syn.make_generator("reverse", max_length=6)
    lengths = set()
    for i in range(500):
        prompt, answer = base.split_prompt(generator[i]["text"])
        assert re.fullmatch(r"[a-z]+=", prompt) and answer == prompt[:-1][::-1]
        lengths.add(len(answer))
    assert lengths == set(range(1, 7))


@pytest.mark.parametrize(
    ("n", "words"),
    [
        (0, "zero"),
        (7, "seven"),
        (10, "ten"),
        (13, "thirteen"),
        (19, "nineteen"),
        (20, "twenty"),
        (42, "forty-two"),
        (90, "ninety"),
        (99, "ninety-nine"),
        (100, "one hundred"),
        (105, "one hundred five"),
        (115, "one hundred fifteen"),
        (342, "three hundred forty-two"),
        (1_000, "one thousand"),
        (1_001, "one thousand one"),
        (12_345, "twelve thousand three hundred forty-five"),
        (700_000, "seven hundred thousand"),
        (999_999, "nine hundred ninety-nine thousand nine hundred ninety-nine"),
        (1_000_005, "one million five"),
        (20_030_400, "twenty million thirty thousand four hundred"),
    ],
)
def test_number_to_words_hand_cases(n, words):
    assert syn.number_to_words(n) == words


def test_number_to_words_round_trips_and_rejects_out_of_range():
    rng = np.random.default_rng(0)
    numbers = [*range(2_000), *rng.integers(0, syn.MAX_NUMBER + 1, size=2_000).tolist()]
    spelled = [syn.number_to_words(n) for n in numbers]
    assert [parse_number_words(s) for s in spelled] == numbers
    assert not any(_UNHYPHENATED.search(s) or " and " in s for s in spelled)
    for bad in (-1, syn.MAX_NUMBER + 1, 3.0):
        with pytest.raises(ValueError, match="n must be an int"):
            syn.number_to_words(bad)


def test_number_words_examples_are_correct():
    generator = syn.make_generator("number_words", max_value=50_000, size=2000)
    targets = []
    for i in range(len(generator)):
        record = generator[i]
        assert parse_number_words(record["source"]) == int(record["target"]) <= 50_000
        targets.append(int(record["target"]))
    assert min(targets) < 10 and sum(t < 100 for t in targets) > 300  # small numbers are common
    assert max(targets) > 40_000


def _sentiment_rule(text):
    """Label by the documented rule: each clause's adjective polarity, flipped by a negation."""
    total = 0
    for clause in text.split(" and "):
        words = clause.split()
        polarity = (words[-1] in POSITIVE_WORDS) - (words[-1] in NEGATIVE_WORDS)
        total += -polarity if set(words) & set(NEGATIONS) else polarity
    return LABELS.index({-1: "negative", 0: "neutral", 1: "positive"}[total])


def test_sentiment_labels_follow_words_and_negation_and_are_balanced():
    generator = syn.make_generator("sentiment", size=3000)
    records = [generator[i] for i in range(len(generator))]
    assert [r["label"] for r in records] == [_sentiment_rule(r["text"]) for r in records]

    counts = collections.Counter(r["label"] for r in records)
    assert all(abs(counts[c] / len(records) - 1 / 3) < 0.04 for c in range(len(LABELS)))

    # Negation flips: each polar adjective shows up under both polar labels, and a negation word
    # shows up in every class, so neither alone gives the label away.
    labels_of = collections.defaultdict(set)
    negated_in = set()
    for r in records:
        words = r["text"].split()
        for word in set(words) & set(POSITIVE_WORDS + NEGATIVE_WORDS):
            labels_of[word].add(LABELS[r["label"]])
        if set(words) & set(NEGATIONS):
            negated_in.add(r["label"])
    assert set(labels_of) == set(POSITIVE_WORDS + NEGATIVE_WORDS)
    assert all(labels == {"positive", "negative"} for labels in labels_of.values())
    assert negated_in == {0, 1, 2}
    # The clause that carries the label can stand anywhere, so position gives nothing away.
    polar_positions = set()
    for r in records:
        for position, clause in enumerate(r["text"].split(" and ")):
            if clause.split()[-1] not in NEUTRAL_WORDS:
                polar_positions.add(position)
    assert polar_positions == {0, 1, 2}
    assert {r["text"].count(" and ") + 1 for r in records} == {1, 2, 3}
    assert syn.make_generator("sentiment").labels == LABELS


@pytest.mark.parametrize("name", NAMES)
def test_score(name):
    generator = syn.make_generator(name, split="validation", size=10)
    examples = [generator[i] for i in range(len(generator))]
    right = [_reference(generator, e) for e in examples]
    if generator.records == LABELLED_RECORDS:
        wrong = [(label + 1) % len(LABELS) for label in right]
    else:
        wrong = [answer + "1" for answer in right]
        right = [f" {answer}\n" for answer in right]  # surrounding whitespace is ignored
    assert generator.score(right, examples) == {generator.metric: 1.0}
    assert generator.score(wrong, examples) == {generator.metric: 0.0}
    assert generator.score(right[:4] + wrong[4:], examples) == {
        generator.metric: pytest.approx(0.4)
    }
    with pytest.raises(ValueError, match="as many predictions as examples"):
        generator.score(right[:3], examples)
    with pytest.raises(ValueError, match="as many predictions as examples"):
        generator.score([], [])


def test_metric_names():
    metrics = {name: syn.GENERATORS[name].metric for name in NAMES}
    assert metrics == {
        "arithmetic": "exact_match",
        "number_words": "exact_match",
        "reverse": "exact_match",
        "sentiment": "accuracy",
    }


def test_split_prompt():
    assert base.split_prompt("123+45=168") == ("123+45=", "168")
    with pytest.raises(ValueError, match="no '='"):
        base.split_prompt("123+45")


def test_sizes_and_indexing():
    assert len(syn.make_generator("arithmetic")) == base.DEFAULT_SIZES["train"]
    assert (
        len(syn.make_generator("arithmetic", split="validation"))
        == base.DEFAULT_SIZES["validation"]
    )
    generator = syn.make_generator("reverse", size=5)
    assert list(generator) == [generator[i] for i in range(5)]
    for bad in (5, -1):
        with pytest.raises(IndexError, match="out of range"):
            generator[bad]


def test_unknown_generator_lists_valid_names():
    with pytest.raises(ValueError, match="unknown synthetic generator 'addition'") as info:
        syn.make_generator("addition")
    assert all(name in str(info.value) for name in NAMES)


def test_unknown_option_is_named_with_the_valid_ones():
    with pytest.raises(
        ValueError, match=r"max_digit, vocab .*'arithmetic'.*max_digits, subtraction, fixed_width"
    ):
        syn.make_generator("arithmetic", max_digit=3, vocab=10)


@pytest.mark.parametrize(
    ("name", "kwargs", "message"),
    [
        ("arithmetic", {"max_digits": 0}, "max_digits must be an int in"),
        ("arithmetic", {"subtraction": "yes"}, "subtraction must be a bool"),
        ("arithmetic", {"fixed_width": 1}, "fixed_width must be a bool"),
        ("number_words", {"max_value": 10**9}, "max_value must be an int in"),
        ("sentiment", {"max_clauses": 0}, "max_clauses must be an int in"),
        ("reverse", {"max_length": True}, "max_length must be an int"),
        ("reverse", {"split": "test"}, "split must be one of"),
        ("reverse", {"seed": -1}, "seed must be an int >= 0"),
        ("reverse", {"size": 0}, r"size must be an int in \[1, 10000000\]"),
        ("reverse", {"size": 10**20}, r"size must be an int in \[1, 10000000\]"),  # not a hang
    ],
)
def test_bad_values_are_named(name, kwargs, message):
    with pytest.raises(ValueError, match=message):
        syn.make_generator(name, **kwargs)


def test_a_domain_too_small_for_a_split_fails_at_construction():
    # The only input, "zero", belongs to exactly one split; the other split cannot be built.
    failures = []
    for split in base.SPLITS:
        try:
            syn.make_generator("number_words", split=split, max_value=0)
        except ValueError as error:
            assert "widen the domain" in str(error)
            failures.append(split)
    assert failures == [s for s in base.SPLITS if s != base.split_of("zero")]


# --- documents: every example tokenized at once ---------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_documents_hold_the_records_tokenized_across_chunks(name):
    size = base.CHUNK + 7  # two chunks
    generator = syn.make_generator(name, seed=2, size=size)
    documents = generator.documents(ByteTokenizer())
    assert len(documents) == size
    tokenizer = ByteTokenizer()
    for i in (0, 1, base.CHUNK - 1, base.CHUNK, size - 1):
        record = generator[i]
        for field in documents.fields:
            assert tokenizer.decode(documents.document(field, i)) == record[field]
        if generator.records == LABELLED_RECORDS:
            assert documents.labels[i] == record["label"]
    # The digests are the hashes that assigned each input to this split.
    keys = [_key(generator, generator[i]) for i in range(50)]
    expected = stable_hash(ByteTexts.from_strings(keys))
    np.testing.assert_array_equal(documents.digests[:50], expected)
    assert (
        syn.make_generator(name, seed=2, size=2 * base.CHUNK)[base.CHUNK + 3]
        == generator[base.CHUNK + 3]
    )


def test_documents_with_a_fitted_tokenizer_encode_each_text():
    generator = syn.make_generator("number_words", size=300)
    tokenizer = make_tokenizer("word", texts=[generator[i]["source"] for i in range(300)])
    documents = generator.documents(tokenizer)
    assert documents.tokens["source"].dtype == np.uint16
    for i in (0, 299):
        assert documents.document("source", i).tolist() == tokenizer.encode(generator[i]["source"])
        assert documents.document("target", i).tolist() == tokenizer.encode(generator[i]["target"])


def test_documents_are_kept_read_only_for_an_equal_generator_and_tokenizer():
    built = syn.make_generator("number_words", size=300).documents(ByteTokenizer())
    assert syn.make_generator("number_words", size=300).documents(ByteTokenizer()) is built
    with pytest.raises(ValueError, match="read-only"):
        built.tokens["source"][0] = 0
    other_seed = syn.make_generator("number_words", size=300, seed=1).documents(ByteTokenizer())
    assert other_seed is not built
    texts = [syn.make_generator("number_words", size=300)[i]["source"] for i in range(300)]
    word = syn.make_generator("number_words", size=300).documents(
        make_tokenizer("word", texts=texts)
    )
    assert word is not built and word.tokens["source"].size < built.tokens["source"].size


@pytest.mark.parametrize("name", NAMES)
def test_whole_chunks_of_validation_and_train_share_no_input(name):
    train = syn.make_generator(name, seed=0, size=2 * base.CHUNK).documents(ByteTokenizer())
    valid = syn.make_generator(name, seed=1, split="validation").documents(ByteTokenizer())
    assert not set(train.digests.tolist()) & set(valid.digests.tolist())
    assert (valid.digests < np.uint64(int(base.VALIDATION_FRACTION * 2**64))).all()


def test_generator_options_come_from_the_data_config_and_bad_ones_are_named():
    from flaxformer_lite.train.config import ConfigError, load_config

    options = ["data.generator_options.max_digits=2", "data.generator_options.fixed_width=true"]
    cfg = load_config(None, options)
    assert cfg.data.generator_options["max_digits"] == 2
    with pytest.raises(ConfigError, match="data.generator_options.*max_digit.*valid options"):
        load_config(None, ["data.generator_options.max_digit=2"])
    with pytest.raises(ConfigError, match="data.generator_options.*max_length"):
        load_config(None, ["data.generator=reverse", "data.generator_options.max_length=0"])
