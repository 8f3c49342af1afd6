"""Downstream tasks: a task file's examples, the requests that score them and the metrics, as
lm-evaluation-harness computes them from the same log-likelihoods:

* multiple choice: ``acc``, the share of examples whose answer has the highest log-likelihood,
  and ``acc_norm``, the same with each log-likelihood divided by its choice's length in
  characters (lm-eval's ``multiple_choice`` ``process_results``);
* a last word (LAMBADA): ``acc``, the share whose last word is the greedy continuation, and
  ``perplexity``, ``exp`` of the mean negative log-likelihood of the last words;
* text: ``token_perplexity`` (``exp`` of the mean negative log-likelihood per token of the
  model's tokenizer), ``byte_perplexity``, ``bits_per_byte`` and ``word_perplexity`` (lm-eval's
  ``loglikelihood_rolling`` metrics, over UTF-8 bytes and whitespace-separated words). As
  lm-eval's Hugging Face model, the text's tokens are those its inputs start with: a tokenizer
  that starts them with ``<sos>`` (a run's, Llama's) has its ``<sos>`` scored, after a
  ``<sos>``, as one of them.

:class:`Tasks` holds a run's tasks tokenized once, their requests scored together.
"""

from __future__ import annotations

import abc
import math
import re
from collections.abc import Sequence

import numpy as np

from flaxformer_lite.data.tokenizers import Tokenizer
from flaxformer_lite.evals.config import EvalsConfig, TaskFile
from flaxformer_lite.evals.formats import TaskFileError, format_named, format_of, read_task_file
from flaxformer_lite.evals.requests import Request, encode_pair, rolling_requests, text_ids

# lm-eval's default target_delimiter: a choice or last word follows its context after it.
DELIMITER = " "
PREFIX = "task/"  # a task's metrics are task/<name>/<metric>
# What a task's metrics are over (task/<name>/<unit>: a count, not a result), and the metric
# that stands for a task in a table: the first of HEADLINES it has.
UNITS = ("examples", "tokens")
HEADLINES = ("acc_norm", "acc", "byte_perplexity")


def is_count(key: str) -> bool:
    """Whether a logged ``key`` is what a task's metrics are over (``task/<name>/examples``)."""
    return key.startswith(PREFIX) and key.rsplit("/", 1)[-1] in UNITS


def headline_metrics(keys) -> list[str]:
    """Of logged ``keys``, the one metric of each task that a table shows (``acc_norm`` of a
    multiple-choice task, ``acc`` of LAMBADA, ``byte_perplexity`` of a text)."""
    tasks: dict[str, set[str]] = {}
    for key in keys:
        if key.startswith(PREFIX) and key.count("/") == 2:
            _, name, metric = key.split("/")
            tasks.setdefault(name, set()).add(metric)
    return [
        f"{PREFIX}{name}/{next(m for m in HEADLINES if m in metrics)}"
        for name, metrics in tasks.items()
        if any(m in metrics for m in HEADLINES)
    ]


class DownstreamTask(abc.ABC):
    """A task file's examples and how they are scored."""

    unit = "examples"

    def __init__(self, name: str, examples: list):
        self.name, self.examples = name, examples

    @abc.abstractmethod
    def requests(self, tokenizer: Tokenizer, length: int) -> list[Request]:
        """The requests that score the examples, in a row of ``length`` positions.

        Raises:
          TaskFileError: an example whose continuation does not fit (naming its line).
        """

    @abc.abstractmethod
    def metrics(self, loglikelihood: np.ndarray, greedy: np.ndarray) -> dict[str, float]:
        """The task's metrics from its requests' log-likelihoods and greedy flags."""

    @property
    def size(self) -> int:
        """What the metrics are over: examples, or a text's tokens (:attr:`unit`)."""
        return len(self.examples)


class MultipleChoice(DownstreamTask):
    def requests(self, tokenizer, length):
        requests = []
        for example in self.examples:
            for number, choice in enumerate(example.choices):
                what = f"{example.where}: choice {number}"
                requests.append(_fitting(tokenizer, example.context, choice, length, what))
        return requests

    def metrics(self, loglikelihood, greedy):
        hits = {"acc": 0, "acc_norm": 0}
        start = 0
        for example in self.examples:
            scores = loglikelihood[start : start + len(example.choices)]
            start += len(example.choices)
            lengths = np.array([float(len(choice)) for choice in example.choices])
            hits["acc"] += int(np.argmax(scores)) == example.answer
            hits["acc_norm"] += int(np.argmax(scores / lengths)) == example.answer
        return {name: count / len(self.examples) for name, count in hits.items()}


class LastWord(DownstreamTask):
    def requests(self, tokenizer, length):
        requests = []
        for example in self.examples:
            *words, last = example.text.split(" ")
            context = " ".join(words)
            requests.append(_fitting(tokenizer, context, last, length, example.where))
        return requests

    def metrics(self, loglikelihood, greedy):
        return {
            "acc": float(np.mean(greedy)),
            "perplexity": _exp(-float(np.mean(loglikelihood))),
        }


class Text(DownstreamTask):
    unit = "tokens"

    def __init__(self, name: str, examples: list):
        super().__init__(name, examples)
        self._tokens = 0  # counted by requests(), with the tokenizer

    def requests(self, tokenizer, length):
        self._tokens = 0
        requests = []
        for example in self.examples:
            ids = text_ids(tokenizer, example.text)
            self._tokens += len(ids)
            requests.extend(rolling_requests(ids, tokenizer.sos_id, length))
        return requests

    def metrics(self, loglikelihood, greedy):
        total = -float(np.sum(loglikelihood, dtype=np.float64))
        size = {
            "token": self._tokens,
            "byte": sum(len(example.text.encode("utf-8")) for example in self.examples),
            "word": sum(len(re.split(r"\s+", example.text)) for example in self.examples),
        }
        values = {f"{unit}_perplexity": _exp(total / max(n, 1)) for unit, n in size.items()}
        return values | {"bits_per_byte": total / max(size["byte"], 1) / math.log(2)}

    @property
    def size(self) -> int:
        return self._tokens


KINDS = {"choice": MultipleChoice, "last_word": LastWord, "text": Text}


def load_task(name: str, task_file: TaskFile) -> DownstreamTask:
    """The task ``evals.tasks.<name>`` names, its examples read.

    Raises:
      TaskFileError: an unknown format, or a file it cannot read (naming the file and line).
    """
    format_name = format_of(name, task_file.path, task_file.format)
    setting = f"evals.tasks.{name}" + (".format" if task_file.format else "")
    reader = format_named(format_name, setting)
    examples = read_task_file(task_file.path, format_name, task_file.limit)
    return KINDS[reader.kind](name, examples)


def read_tasks(evals: EvalsConfig) -> list[DownstreamTask]:
    """Every task of an ``evals`` config section, its file read.

    Raises:
      TaskFileError: as :func:`load_task`.
    """
    return [load_task(name, task_file) for name, task_file in evals.tasks.items()]


class Tasks:
    """A run's downstream tasks tokenized for rows of ``length`` positions: every request of
    every task (:attr:`requests`), scored together, and the metrics of each."""

    def __init__(self, tasks: Sequence[DownstreamTask], tokenizer: Tokenizer, length: int):
        self.tasks, self.length = list(tasks), length
        self.requests: list[Request] = []
        self.spans = []
        for task in self.tasks:
            requests = task.requests(tokenizer, length)
            self.spans.append(slice(len(self.requests), len(self.requests) + len(requests)))
            self.requests.extend(requests)

    @property
    def tokens(self) -> int:
        """The positions the requests fill (each request's tokens, less one)."""
        return sum(len(request.tokens(self.length)) - 1 for request in self.requests)

    def notices(self) -> list[str]:
        """What the run says of its tasks before it trains: requests cut to fit."""
        lines = []
        for task, span in zip(self.tasks, self.spans, strict=True):
            cut = sum(request.cut(self.length) for request in self.requests[span])
            if cut:
                lines.append(
                    f"task {task.name}: {cut} of {span.stop - span.start} requests are longer "
                    f"than {self.length + 1} tokens: their contexts are cut from the left, as "
                    "lm-eval cuts them (the continuation is kept)"
                )
        return lines

    def metrics(self, loglikelihood: np.ndarray, greedy: np.ndarray) -> dict[str, float]:
        """``task/<name>/<metric>`` of every task, and ``task/<name>/examples`` (``tokens``
        for text), what its metrics are over."""
        values = {}
        for task, span in zip(self.tasks, self.spans, strict=True):
            scores = task.metrics(loglikelihood[span], greedy[span])
            values |= {f"{PREFIX}{task.name}/{key}": value for key, value in scores.items()}
            values[f"{PREFIX}{task.name}/{task.unit}"] = task.size
        return values


def _fitting(tokenizer, context: str, continuation: str, length: int, where: str) -> Request:
    """The request of ``continuation`` after ``context`` (:data:`DELIMITER` between), refused
    where its continuation alone does not fit a row."""
    try:
        request = encode_pair(tokenizer, context, DELIMITER + continuation)
    except ValueError as error:
        raise TaskFileError(f"{where}: {error}") from None
    try:
        request.check(length)
    except ValueError as error:
        raise TaskFileError(f"{where}: {error}") from None
    return request


def _exp(value: float) -> float:
    return math.exp(min(value, 700.0))
