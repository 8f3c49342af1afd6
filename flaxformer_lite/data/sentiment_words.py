"""The words of the ``sentiment`` synthetic generator's template reviews, by label, and the byte
tables it renders them from (:class:`~flaxformer_lite.data.synthetic.SentimentGenerator` says how
the clauses are built from them).
"""

from __future__ import annotations

from flaxformer_lite.data.byte_texts import table


def _words(text: str) -> tuple[str, ...]:
    return tuple(text.split())


LABELS = ("negative", "neutral", "positive")
POSITIVE_WORDS = _words(
    "good great excellent wonderful pleasant delightful superb lovely fantastic enjoyable"
)
NEGATIVE_WORDS = _words(
    "bad terrible awful horrible poor dreadful boring disappointing unpleasant mediocre"
)
NEUTRAL_WORDS = _words("red blue green square round wooden metal tall wide plastic")
NEGATIONS = ("not", "never")
NOUNS = _words("food movie service room book song hotel game show car table door")
INTENSIFIERS = ("very", "really", "quite")
ADJECTIVES = table(NEGATIVE_WORDS + NEUTRAL_WORDS + POSITIVE_WORDS)  # 10 of each, by label
CLAUSE_WORDS = {
    "noun": table([f"the {noun} " for noun in NOUNS]),
    "verb": table(["was", "is"]),
    "negation": table([f" {word}" for word in NEGATIONS]),
    "intensifier": table([f" {word}" for word in INTENSIFIERS]),
}
