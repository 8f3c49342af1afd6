"""What the training loop does at the steps it is due, each an action with ``due(step, final)``
(whether it is due after ``step``; ``final``: the run's last) and ``__call__(end)`` over that
step's :class:`StepEnd`: log the training metrics (:class:`LogTrain`), evaluate
(:class:`Evaluate`), score the downstream tasks (:class:`EvaluateTasks`), save a checkpoint
(:class:`SaveCheckpoint`). :class:`FiniteCheck` reads each step's finite flag, and
:class:`Throughput` times the steps in between.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import time
from typing import Any

import jax
import numpy as np
from flax import nnx

from flaxformer_lite.data import Task
from flaxformer_lite.decode.generate import compile_only
from flaxformer_lite.decode.text import printable
from flaxformer_lite.train.background_compile import BackgroundCompile
from flaxformer_lite.train.checkpoint import Checkpointer
from flaxformer_lite.train.checkpoint_format import to_savable
from flaxformer_lite.train.console import Console
from flaxformer_lite.train.decode_eval import continue_texts, decodable, decode_eval
from flaxformer_lite.train.time_spent import TimeSpent


class TrainingError(RuntimeError):
    """The run cannot go on (a non-finite step, a changed config); the message says why."""


@dataclasses.dataclass
class StepEnd:
    """A finished step as the actions due at it see it.

    Attributes:
      step: the optimizer steps done.
      state: the train state after it.
      metrics: the step's metrics, on the devices.
      data_state: the data iterator's state after the batches of steps up to ``step``.
      final: the run's last step: ``train.steps``, or the step a stop signal ended.
      values: the metrics the actions logged at this step (written to ``metrics.jsonl``).
    """

    step: int
    state: Any
    metrics: dict
    data_state: dict
    final: bool
    values: dict = dataclasses.field(default_factory=dict)


def every(interval: int, total: int, step: int) -> bool:
    """Whether an action done every ``interval`` steps, and at the run's ``total``, is due."""
    return step % interval == 0 or step == total


class Throughput:
    """Tokens/s and MFU over the steady-state training steps since :meth:`restart`: the first
    step (compiled) and the steps' evaluations and saves are not timed."""

    def __init__(self, tokens_per_step: int, flops_per_token: float, peak: float | None, log):
        self.tokens_per_step, self.flops_per_token = tokens_per_step, flops_per_token
        self.peak, self.log = peak, log
        self.started: float | None = None
        self.first_step = 0
        self._held: tuple[int, tuple] | None = None

    def compiled(self, step: int, step_started: float) -> None:
        """After the first step, which compiled the step function."""
        self.log(f"compiled the train step in {time.perf_counter() - step_started:.1f} s")
        self.restart(step)

    def restart(self, step: int) -> None:
        self.started, self.first_step = time.perf_counter(), step

    def hold(self, step: int) -> None:
        """Takes the rates at ``step`` now: what :meth:`rates` gives at ``step`` after, for
        every run the step advanced, whatever is done in between (another's evaluation)."""
        self._held = None
        self._held = (step, self.rates(step))

    def rates(self, step: int) -> tuple[float | None, float | None]:
        """``(tokens_per_sec, mfu)`` since the restart (or as held at ``step``); None before a
        step was timed."""
        if self._held is not None and self._held[0] == step:
            return self._held[1]
        steps = step - self.first_step
        if not steps:
            return None, None
        tokens_per_sec = steps * self.tokens_per_step / (time.perf_counter() - self.started)
        mfu = self.flops_per_token * tokens_per_sec / self.peak if self.peak else None
        return tokens_per_sec, mfu


class FiniteCheck:
    """Reads the lanes' finite flags of a step once the next step is dispatched (or at once when
    the step is due for an action), and hands each lane's non-finite step to its
    ``on_nonfinite(step, metrics)`` (log it, freeze the lane, or stop the run)."""

    def __init__(self, on_nonfinite: list, program):
        self.on_nonfinite, self.program = on_nonfinite, program
        self._unchecked: tuple[int, Any] | None = None

    def later(self, step: int, metrics) -> None:
        """Checks the step before ``step`` (queued behind it) and keeps ``step``'s flags."""
        self.now()
        self._unchecked = (step, metrics)

    def now(self) -> None:
        """Checks the step kept last, waiting for it."""
        if self._unchecked is None:
            return
        (step, metrics), self._unchecked = self._unchecked, None
        for index, finite in enumerate(self.program.finite(metrics)):
            if not finite:
                self.on_nonfinite[index](step, self.program.member_metrics(metrics, index))


def nonfinite_error(
    step: int, loss: float, checkpointer: Checkpointer, resumed_step: int | None
) -> TrainingError:
    """The error that stops a run at its non-finite step ``step``, naming its last good
    checkpoint (a save in flight is waited for: it is good)."""
    message = (
        f"step {step}: the loss or a gradient is not finite (loss {loss}); the update was "
        "skipped and the run stopped"
    )
    checkpointer.wait()
    newest = checkpointer.latest_step()
    if newest is None:
        where = "last good checkpoint: none written yet"
    elif newest == resumed_step:  # restored, not saved from steps checked here
        where = f"newest checkpoint: step {newest}, the one this run resumed from"
    else:
        where = f"last good checkpoint: step {newest}"
    return TrainingError(f"{message}; {where}")


class LogTrain:
    """Every ``train.log_every`` steps: the step's loss, accuracy, gradient norm, learning rate
    and throughput."""

    part = None  # reading the step's metrics waits for it: the steps' time

    def __init__(self, interval: int, total: int, rates, throughput: Throughput, console):
        """``rates``: the learning rate by optimizer step, the step's own table of them."""
        self.interval, self.total, self.rates = interval, total, np.asarray(rates)
        self.throughput, self.console = throughput, console

    def due(self, step: int, final: bool) -> bool:
        return every(self.interval, self.total, step)

    def __call__(self, end: StepEnd) -> None:
        values = {k: float(end.metrics[k]) for k in ("loss", "accuracy", "grad_norm")}
        values["learning_rate"] = float(self.rates[min(end.step, len(self.rates)) - 1])
        values["tokens_per_sec"], values["mfu"] = self.throughput.rates(end.step)
        self.console.logged(end.step, values)
        end.values |= values


class Evaluate:
    """Every ``train.eval_every`` steps: the loss and accuracy over the validation batches
    (``train.eval_batches`` of them, default all), perplexity, and decoded samples; for a
    mixture, each source's too (``eval_loss/<name>``, ..., the cap per source; decoded scores
    per source only). With ``compiled``, the first evaluation waits for its programs, which
    :meth:`compile` compiles on that thread, instead of compiling them itself."""

    part = "evaluations"

    def __init__(
        self,
        cfg,
        data,
        task: Task,
        eval_step,
        eval_graphdef,
        place,
        console: Console,
        compiled: BackgroundCompile | None = None,
    ):
        self.cfg, self.data, self.task, self.eval_step = cfg, data, task, eval_step
        self.eval_graphdef, self.place, self.console = eval_graphdef, place, console
        self.compiled = compiled

    def due(self, step: int, final: bool) -> bool:
        return every(self.cfg.train.eval_every, self.cfg.train.steps, step)

    def compile(self, state) -> None:
        """Compiles, without running them, the programs an evaluation of a train state shaped
        like ``state`` (arrays or ``jax.ShapeDtypeStruct``s, with their shardings) runs: the
        eval step on a validation batch, and the decoding of :func:`decoded_eval`."""
        batch = next(self.data.eval_batches(), None)
        if batch is not None:
            self.eval_step.lower(state, self.place(batch)).compile()
        model = nnx.merge(self.eval_graphdef, state)[0]
        with compile_only():
            self._decoded(model, 0, log=quiet)

    def __call__(self, end: StepEnd) -> None:
        if self.compiled is not None:
            self.compiled.wait()
        cap = self.cfg.train.eval_batches
        if self.data.sources:  # each source's pass on its own, then over all of them
            by_source = {
                name: evaluate(self.eval_step, end.state, map(self.place, part.make_batches()), cap)
                for name, part in self.data.sources.items()
            }
            scores = pooled(by_source.values())
            for name, values in by_source.items():
                scores |= {
                    f"{key}/{name}": value for key, value in self._perplexity(values).items()
                }
        else:
            scores = evaluate(
                self.eval_step, end.state, map(self.place, self.data.eval_batches()), cap
            )
        scores = self._perplexity(scores)
        model = nnx.merge(self.eval_graphdef, end.state)[0]
        scores |= self._decoded(model, end.step, self.console.say)
        over = eval_coverage(self.cfg, self.data, self.task, scores["eval_tokens"])
        self.console.evaluated(end.step, scores, over)
        end.values |= scores

    def _decoded(self, model, step: int, log) -> dict[str, float]:
        """:func:`decoded_eval`'s scores of ``model``; a mixture's per source (``key/name``),
        since a corpus BLEU does not pool."""
        scores = {}
        for index, (name, part) in enumerate(self.data.sources.items() or [("", self.data)]):
            decoded = decoded_eval(
                self.cfg, self.data, part.eval_examples, self.task, model, step, log, index
            )
            scores |= {f"{key}/{name}" if name else key: value for key, value in decoded.items()}
        return scores

    def _perplexity(self, scores: dict[str, float]) -> dict[str, float]:
        if not self.task.perplexity:
            return scores
        return {**scores, "eval_perplexity": math.exp(min(scores["eval_loss"], 80.0))}


class EvaluateTasks:
    """Every ``evals.every`` steps (default: at each evaluation) and at the run's end: the
    downstream tasks' metrics (``task/<name>/<metric>``, :mod:`flaxformer_lite.evals`), every
    process scoring its rows of each batch."""

    part = "tasks"

    def __init__(self, cfg, tasks, scorer, eval_graphdef, console: Console):
        self.interval = cfg.evals.every or cfg.train.eval_every
        self.total, self.tasks, self.scorer = cfg.train.steps, tasks, scorer
        self.eval_graphdef, self.console = eval_graphdef, console

    def due(self, step: int, final: bool) -> bool:
        return every(self.interval, self.total, step)

    def __call__(self, end: StepEnd) -> None:
        model = nnx.merge(self.eval_graphdef, end.state)[0]
        values = self.tasks.metrics(*self.scorer(model, self.tasks.requests))
        self.console.tasks_scored(end.step, values)
        end.values |= values


class SaveCheckpoint:
    """Every ``checkpoint.every`` steps and at the run's last step (the end, or a stop signal):
    the state (a LoRA run's without its ``base``, which it names), the data iterator's state,
    the config and the step's eval loss."""

    part = "checkpoints"

    def __init__(self, checkpointer: Checkpointer, cfg, base: dict | None = None):
        self.checkpointer, self.cfg, self.base = checkpointer, cfg, base

    def due(self, step: int, final: bool) -> bool:
        return final or step % self.cfg.checkpoint.every == 0

    def __call__(self, end: StepEnd) -> None:
        eval_loss = end.values.get("eval_loss")
        self.checkpointer.save(
            end.step,
            to_savable(end.state),
            data_state=end.data_state,
            config=self.cfg.to_dict(),
            force=end.final,
            metrics=None if eval_loss is None else {"eval_loss": eval_loss},
            base=self.base,
        )


def run_actions(
    due: list, end: StepEnd, checkpointer: Checkpointer, spent: TimeSpent | None = None
) -> None:
    """Runs the actions ``due`` at ``end``, in order (a save last: it keeps the step's eval
    loss), each counted to its ``part`` of ``spent``. One that fails (an evaluation, a log line)
    first lets the save due at the same step be written, so that the error never costs the
    steps trained."""
    for number, action in enumerate(due):
        timed = spent is not None and action.part is not None
        try:
            with spent.part(action.part) if timed else contextlib.nullcontext():
                action(end)
        except Exception:
            for save in (a for a in due[number + 1 :] if isinstance(a, SaveCheckpoint)):
                save(end)
                checkpointer.wait()
            raise


def evaluate(eval_step, state, batches, max_batches: int | None = None) -> dict[str, float]:
    """Token-weighted ``eval_loss`` and ``eval_accuracy`` over every batch (or the first
    ``max_batches``), and ``eval_tokens``, the number of (weighted) tokens they are over.

    Each batch's means come back from the devices in float32; the sums over batches are made in
    float64 on the host, so a long validation set adds up exactly."""
    totals = {"loss": 0.0, "accuracy": 0.0, "num_tokens": 0.0}
    for batch in itertools.islice(batches, max_batches):
        metrics = eval_step(state, batch)
        count = float(metrics["num_tokens"])
        totals["num_tokens"] += count
        for key in ("loss", "accuracy"):
            totals[key] += float(metrics[key]) * count
    count = max(totals["num_tokens"], 1e-8)
    return {
        "eval_loss": totals["loss"] / count,
        "eval_accuracy": totals["accuracy"] / count,
        "eval_tokens": round(totals["num_tokens"]),  # weights are 0 or 1: a count
    }


def pooled(scores) -> dict[str, float]:
    """:func:`evaluate`'s values over several passes' tokens together (each weighted by its
    ``eval_tokens``)."""
    scores = list(scores)
    tokens = sum(values["eval_tokens"] for values in scores)
    count = max(tokens, 1e-8)
    pooled = {
        key: sum(values[key] * values["eval_tokens"] for values in scores) / count
        for key in ("eval_loss", "eval_accuracy")
    }
    return {**pooled, "eval_tokens": tokens}


def eval_coverage(cfg, data, task: Task, counted: float) -> str:
    """What an evaluation of ``counted`` weighted targets is over, in words: all the validation
    targets (tokens; a classifier's examples; an MLM's masked tokens), or the share
    ``train.eval_batches`` leaves."""
    what = task.unit
    capped = cfg.train.eval_batches
    counts = [part.batch_count for part in data.sources.values()] or [data.eval_batch_count]
    if capped is None or capped >= max(counts):
        return f"every one of {counted:,.0f} validation {what}"
    batches = f"train.eval_batches={capped} of {data.eval_batch_count} batches"
    if data.sources:
        covered = sum(min(capped, count) for count in counts)
        batches = f"train.eval_batches={capped} per source: {covered} of {sum(counts)} batches"
    if data.eval_tokens is None:
        return f"{counted:,.0f} validation {what} of the first {batches}"
    share = counted / max(data.eval_tokens, 1)
    return f"{counted:,.0f} of the {data.eval_tokens:,} validation tokens, {share:.1%}: {batches}"


def decoded_eval(
    cfg, data, examples, task: Task, model, step: int, log, source: int = 0
) -> dict[str, float]:
    """Greedy-decodes ``train.decode_examples`` of the validation ``examples`` (all of
    ``data``'s, or a mixture's ``source``-th's), logs ``train.log_samples`` of them, and returns
    their scores and ``eval_decoded_examples``, how many were decoded; on plain text, logs
    ``train.log_samples`` sampled continuations of validation prompts (no score: text has no
    answer to compare with), each source's with a key of its own."""
    if jax.process_count() > 1:  # the prompts are not split over processes
        return {}
    # One batch of prompts on whatever devices hold the parameters: no activation layout rules.
    with nnx.logical_axis_rules(()):
        if task.continues and cfg.train.log_samples and not decodable(task, examples):
            samples = continue_texts(
                model,
                data.tokenizer,
                examples,
                num_samples=cfg.train.log_samples,
                max_length=min(cfg.model.max_length, cfg.data.seq_len),
                # A mixture's sources each their own key; one source the key it always had.
                rng=jax.random.fold_in(jax.random.key(cfg.seed + step), source)
                if source
                else jax.random.key(cfg.seed + step),
            )
            for number, sample in enumerate(samples, 1):
                prediction = printable(sample.prediction)
                log(f"step {step} sample {number} (prompt {sample.input!r}):\n{prediction}")
            return {}
        if not cfg.train.decode_examples or not decodable(task, examples):
            return {}
        values, samples = decode_eval(
            model,
            data.tokenizer,
            examples,
            task=task,
            num_examples=cfg.train.decode_examples,
            max_length=cfg.model.max_length,
        )
    for sample in samples[: cfg.train.log_samples]:
        log(
            f"step {step} sample {sample.input!r} -> {sample.prediction!r} "
            f"(reference {sample.reference!r})"
        )
    return values | {"eval_decoded_examples": len(samples)}


def quiet(_message: str) -> None:
    """A log that drops its messages."""
