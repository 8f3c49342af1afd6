"""American English number words, as the ``number_words`` synthetic generator writes them."""

from __future__ import annotations

import numpy as np

MAX_NUMBER = 10**9 - 1  # number_to_words knows "thousand" and "million"


def _words(text: str) -> tuple[str, ...]:
    return tuple(text.split())


_ONES = _words(
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen "
    "fifteen sixteen seventeen eighteen nineteen"
)
_TENS = ("", "") + _words("twenty thirty forty fifty sixty seventy eighty ninety")  # by tens digit


def below_thousand(n: int) -> list[str]:
    words = []
    hundreds, rest = divmod(n, 100)
    if hundreds:
        words += [_ONES[hundreds], "hundred"]
    if rest >= 20:
        tens, ones = divmod(rest, 10)
        words.append(_TENS[tens] + (f"-{_ONES[ones]}" if ones else ""))
    elif rest:
        words.append(_ONES[rest])
    return words


def number_to_words(n: int) -> str:
    """American English words for ``0 <= n <= MAX_NUMBER``.

    342 -> "three hundred forty-two": no "and" after "hundred", hyphenated tens, and empty
    groups skipped (1_000_005 -> "one million five").
    """
    if isinstance(n, bool) or not isinstance(n, int | np.integer) or not 0 <= n <= MAX_NUMBER:
        raise ValueError(f"n must be an int in [0, {MAX_NUMBER}], got {n!r}")
    if n == 0:
        return "zero"
    words = []
    for scale, name in ((10**6, ["million"]), (10**3, ["thousand"]), (1, [])):
        group, n = divmod(n, scale)
        if group:
            words += below_thousand(group) + name
    return " ".join(words)
