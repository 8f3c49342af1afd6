"""Task files, read as lm-evaluation-harness reads the same data (its task YAMLs and
``utils.py`` say how): each format turns a file's lines into examples of one kind.

* multiple choice (:class:`Choice`: a context, its choices, the answer's index; each choice is
  scored as ``context + " " + choice``, lm-eval's default ``target_delimiter``):
  ``hellaswag`` (the released ``hellaswag_val.jsonl``, or Hugging Face's ``Rowan/hellaswag``:
  ``activity_label``, ``ctx_a``, ``ctx_b``, ``endings``, ``label``), ``arc`` (``question``,
  ``choices`` ``{text, label}``, ``answerKey``; AI2's release, with ``question.stem``, too),
  ``piqa`` (``goal``, ``sol1``, ``sol2``, ``label``) and ``choice``, one plain format for a
  task of one's own: ``{"context": ..., "choices": [...], "answer": 0}``;
* a passage's last word (:class:`Passage`): ``lambada`` (``{"text": ...}``, LAMBADA's jsonl);
* text whose perplexity is measured (:class:`Passage`): ``text``, a text file (one document)
  or a ``.jsonl`` file (``.jsonl.gz``, ``.jsonl.xz``) with a ``text`` field (one document per
  line).

Two tasks ship with the package, made from the part of Tiny Shakespeare that the
``shakespeare_char`` recipe holds out (``tests/shakespeare_tasks.py`` makes them):
``builtin:shakespeare_next_line`` (multiple choice: a line's true rest among four) and
``builtin:shakespeare_last_word`` (a speech's last word, LAMBADA's shape).

A problem raises :class:`TaskFileError` naming the file and line.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from pathlib import Path

from flaxformer_lite.data import readers


class TaskFileError(ValueError):
    """A task file that cannot be read as its format says; the message names the file and
    line."""


@dataclasses.dataclass(frozen=True)
class Choice:
    """A multiple-choice example; ``where`` is its ``file:line``."""

    context: str
    choices: tuple[str, ...]
    answer: int
    where: str


@dataclasses.dataclass(frozen=True)
class Passage:
    """A text: a passage whose last word is predicted, or a document whose perplexity is
    measured; ``where`` is its ``file:line`` (the file, for a whole text file)."""

    text: str
    where: str


def _hellaswag_text(text: str) -> str:
    """lm-eval's ``hellaswag/utils.py`` ``preprocess``: WikiHow's bracketed artifacts out."""
    text = text.strip().replace(" [title]", ". ")
    text = re.sub("\\[.*?\\]", "", text)
    return text.replace("  ", " ")


def _hellaswag(obj: dict, where: str) -> Choice:
    _fields(obj, where, activity_label=str, ctx_a=str, ctx_b=str, endings=list, label=(int, str))
    context = obj["ctx_a"] + " " + obj["ctx_b"].capitalize()
    return _choice(
        _hellaswag_text(obj["activity_label"] + ": " + context),
        [_hellaswag_text(_text(ending, where, "endings")) for ending in obj["endings"]],
        _index(obj["label"], where, "label"),
        where,
    )


def _arc(obj: dict, where: str) -> Choice:
    question, choices = obj.get("question"), obj.get("choices")
    if isinstance(question, dict):  # AI2's release: {"stem": ..., "choices": [{text, label}]}
        _fields(question, f"{where}: question", stem=str, choices=list)
        items = question["choices"]
        if not all(isinstance(item, dict) for item in items):
            raise TaskFileError(f"{where}: question.choices must be objects {{text, label}}")
        choices = {"text": [i.get("text") for i in items], "label": [i.get("label") for i in items]}
        question = question["stem"]
    _fields({"question": question, "choices": choices}, where, question=str, choices=dict)
    _fields(obj, where, answerKey=str)
    _fields(choices, f"{where}: choices", text=list, label=list)
    labels = choices["label"]
    if obj["answerKey"] not in labels:
        raise TaskFileError(
            f"{where}: answerKey {obj['answerKey']!r} is none of the choices' labels {labels}"
        )
    texts = [_text(text, where, "choices.text") for text in choices["text"]]
    return _choice(f"Question: {question}\nAnswer:", texts, labels.index(obj["answerKey"]), where)


def _piqa(obj: dict, where: str) -> Choice:
    _fields(obj, where, goal=str, sol1=str, sol2=str, label=(int, str))
    label = _index(obj["label"], where, "label")
    return _choice(f"Question: {obj['goal']}\nAnswer:", [obj["sol1"], obj["sol2"]], label, where)


def _plain_choice(obj: dict, where: str) -> Choice:
    _fields(obj, where, context=str, choices=list, answer=int)
    texts = [_text(text, where, "choices") for text in obj["choices"]]
    return _choice(obj["context"], texts, obj["answer"], where)


def _lambada(obj: dict, where: str) -> Passage:
    _fields(obj, where, text=str)
    if len(obj["text"].split(" ")) < 2:
        raise TaskFileError(f"{where}: text must have a word before its last one")
    return Passage(obj["text"], where)


def _document(obj: dict, where: str) -> Passage:
    _fields(obj, where, text=str)
    return Passage(obj["text"], where)


@dataclasses.dataclass(frozen=True)
class Format:
    """How a file of one format is read: each JSON line by ``read``; ``kind``: what its
    examples are (``choice``, ``last_word``, ``text``)."""

    kind: str
    read: Callable[[dict, str], Choice | Passage]


FORMATS: dict[str, Format] = {
    "hellaswag": Format("choice", _hellaswag),
    "arc": Format("choice", _arc),
    "piqa": Format("choice", _piqa),
    "choice": Format("choice", _plain_choice),
    "lambada": Format("last_word", _lambada),
    "text": Format("text", _document),
}
# lm-eval's task names for the same formats.
ALIASES = {"arc_easy": "arc", "arc_challenge": "arc", "lambada_openai": "lambada"}
# Task files in the package (tasks/NAME.jsonl), by ``builtin:NAME``, and their formats.
BUILTIN_TASKS = {"shakespeare_next_line": "choice", "shakespeare_last_word": "lambada"}


def task_path(path: str | Path) -> Path:
    """The file ``path`` names: a path, or a task file of the package (``builtin:NAME``).

    Raises:
      TaskFileError: an unknown built-in name.
    """
    text = str(path)
    if not text.startswith(readers.BUILTIN):
        return Path(path)
    name = text.removeprefix(readers.BUILTIN)
    if name not in BUILTIN_TASKS:
        known = ", ".join(readers.BUILTIN + n for n in BUILTIN_TASKS)
        raise TaskFileError(f"{text}: no such built-in task (there are: {known})")
    return Path(__file__).parent / "tasks" / f"{name}.jsonl"


def format_of(name: str, path: str, format: str | None) -> str:
    """The format of task ``name`` whose file is ``path``: ``format`` if given, a built-in
    task's own, else the task's name (``hellaswag``)."""
    if format is not None:
        return format
    builtin = str(path).removeprefix(readers.BUILTIN)
    if str(path).startswith(readers.BUILTIN) and builtin in BUILTIN_TASKS:
        return BUILTIN_TASKS[builtin]
    return name


def format_named(name: str, where: str) -> Format:
    """The :class:`Format` called ``name`` (or one of :data:`ALIASES`).

    Raises:
      TaskFileError: an unknown name; ``where`` says which setting gave it.
    """
    name = ALIASES.get(name, name)
    if name not in FORMATS:
        known = ", ".join(FORMATS)
        raise TaskFileError(f"{where}: unknown task format {name!r}; known: {known}")
    return FORMATS[name]


def read_task_file(path: str | Path, format: str, limit: int | None = None) -> list:
    """The first ``limit`` (None: all) examples of the ``format`` file at ``path``.

    Raises:
      TaskFileError: a missing or empty file, a line that is not JSON or lacks a field, a label
        out of range, no choices (the message names the file and line).
    """
    reader = format_named(format, str(path))
    path = task_path(path)
    examples: list = []
    try:
        if reader.kind == "text" and ".jsonl" not in path.suffixes:  # x.jsonl.gz is jsonl
            return [Passage(readers.read_text(path), str(path))]
        for where, obj in readers.iter_json_objects(path):
            if limit is not None and len(examples) == limit:
                break
            examples.append(reader.read(obj, where))
    except FileNotFoundError:
        raise TaskFileError(f"{path}: no such task file") from None
    except TaskFileError:
        raise
    except ValueError as error:  # not UTF-8, not JSON, empty
        raise TaskFileError(str(error)) from None
    return examples


def _fields(obj: dict, where: str, **types) -> None:
    for field, kind in types.items():
        if field not in obj:
            keys = ", ".join(map(repr, obj)) or "none"
            raise TaskFileError(f"{where}: no field {field!r} (keys: {keys})")
        value = obj[field]
        if not isinstance(value, kind) or isinstance(value, bool):
            names = " or ".join(t.__name__ for t in (kind if isinstance(kind, tuple) else (kind,)))
            raise TaskFileError(
                f"{where}: field {field!r} must be {names}, got {type(value).__name__}"
            )


def _text(value, where: str, field: str) -> str:
    if not isinstance(value, str):
        raise TaskFileError(f"{where}: {field} holds {type(value).__name__}, not text")
    return value


def _index(value: int | str, where: str, field: str) -> int:
    """A label given as a number or its text (``"2"``)."""
    try:
        return int(value)
    except ValueError:
        raise TaskFileError(f"{where}: {field} {value!r} is not an index") from None


def _choice(context: str, choices: list[str], answer: int, where: str) -> Choice:
    if not choices:
        raise TaskFileError(f"{where}: no choices")
    if "" in choices:  # acc_norm divides by its length
        raise TaskFileError(f"{where}: choice {choices.index('')} is empty")
    if not 0 <= answer < len(choices):
        raise TaskFileError(
            f"{where}: the answer's index {answer} is out of range for {len(choices)} choices"
        )
    return Choice(context, tuple(choices), answer, where)
