"""How the built-in Shakespeare tasks (``builtin:shakespeare_next_line``,
``builtin:shakespeare_last_word``, flaxformer_lite/evals/tasks/) are made from Tiny Shakespeare's
last tenth, the part the ``shakespeare_char`` recipe holds out (``data.validation_fraction=0.1``
cuts each file's last tenth of ids; a character's id per character), so a run is never scored
on text it trained on. test_evals.py checks that the shipped files are what this makes.

* next line, multiple choice (HellaSwag's shape): a speech's start up to the middle of one of
  its lines; the choices, that line's true rest and the rests of three other lines of the tail;
* last word (LAMBADA's shape): a speech's start up to the end of one of its lines, whose last
  word (four letters or more, its punctuation dropped) is predicted.
"""

from __future__ import annotations

import re

import numpy as np

EXAMPLES = 200
CHOICES = 4
WORD = re.compile(r"[A-Za-z]{4,}")


def speeches(text: str) -> list[tuple[str, list[str]]]:
    """``(speaker, lines)`` of each speech of the held-out tail of ``text``."""
    tail = text[int(len(text) * 0.9) :]
    tail = tail[tail.index("\n\n") + 2 :]  # from the first whole speech
    found = []
    for block in tail.split("\n\n"):
        head, *lines = block.strip("\n").split("\n")
        if head.endswith(":") and lines:
            found.append((head, lines))
    return found


def make_tasks(text: str) -> dict[str, list[dict]]:
    """The two tasks' records, the same for the same ``text``."""
    rng = np.random.default_rng(0)
    lines = [(speaker, body, i) for speaker, body in speeches(text) for i in range(len(body))]
    long = [entry for entry in lines if len(entry[1][entry[2]].split(" ")) >= 6]
    next_line, last_word = [], []
    for index in rng.permutation(len(long)):
        speaker, body, i = long[index]
        before = "\n".join([speaker, *body[max(0, i - 2) : i]])
        words = body[i].split(" ")
        cut = len(words) // 2
        if len(next_line) < EXAMPLES:
            # Other lines with words past the cut: every choice has some.
            others = [e for e in long if len(e[1][e[2]].split(" ")) > cut]
            picked = [others[j] for j in rng.choice(len(others), CHOICES - 1, replace=False)]
            endings = [" ".join(o[1][o[2]].split(" ")[cut:]) for o in picked]
            truth = " ".join(words[cut:])
            if truth not in endings:
                answer = int(rng.integers(CHOICES))
                endings.insert(answer, truth)
                context = before + "\n" + " ".join(words[:cut])
                next_line.append({"context": context, "choices": endings, "answer": answer})
        last = words[-1].rstrip(",.;:!?'-")
        if len(last_word) < EXAMPLES and WORD.fullmatch(last):
            passage = before + "\n" + " ".join([*words[:-1], last])
            last_word.append({"text": passage})
        if len(next_line) == len(last_word) == EXAMPLES:
            break
    return {"shakespeare_next_line": next_line, "shakespeare_last_word": last_word}
