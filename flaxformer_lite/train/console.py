"""What a run prints while it trains: a progress bar on a terminal, plain lines elsewhere.

With a bar (``bar=True``: the command found a terminal), each logged step's metrics go on the
bar; without one (``--no-progress``, output to a file or a pipe, every job on an accelerator
host), each logged step prints one line::

    step 500/2000: loss 1.627, learning_rate 0.000854, 21.3k tokens/s (positions), 0:00:31 elapsed

Tokens/s count every position of a step's ``batch_size x seq_len`` (padding included; an
encoder-decoder's target positions), as MaxText, levanter and nanoGPT count them. Each
evaluation prints one line either way, naming its step and what each group of metrics is over::

    eval at step 500 (every one of 111,541 validation tokens): eval_loss 1.7412, ...;
    greedy decoding of 256 validation examples: eval_exact_match 0.4141, ...
"""

from __future__ import annotations

import datetime
import time

from flaxformer_lite.evals.tasks import UNITS

# Printed first, in this order; the rest of a step's metrics stay in metrics.jsonl.
_STEP_KEYS = ("loss", "learning_rate")
# An evaluation's metrics from greedy decoding (train.decode_examples examples), not over tokens.
DECODED = ("eval_exact_match", "eval_token_accuracy", "eval_bleu")
# What an evaluation is over: said in words, not listed as metrics.
_COUNTS = ("eval_tokens", "eval_decoded_examples")


class Console:
    """The run's printed progress from step ``initial`` to ``total``; ``log`` prints a line;
    ``members``: the sweep's members one compiled step advances together (each logs its share
    of the step's tokens/s)."""

    def __init__(self, total: int, initial: int, *, bar: bool, log, members: int = 1):
        from tqdm import tqdm

        self.total, self.log, self.members = total, log, members
        self._bar = (
            tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True) if bar else None
        )
        self._started, self._first = time.perf_counter(), initial

    def advance(self) -> None:
        """One more step done."""
        if self._bar is not None:
            self._bar.update(1)

    def logged(self, step: int, values: dict) -> None:
        """A logged step's training metrics (``tokens_per_sec`` may be None: not timed yet)."""
        if self._bar is not None:
            self._bar.set_postfix({k: f"{v:.4g}" for k, v in values.items() if v is not None})
            return
        parts = [f"{k} {values[k]:.4g}" for k in _STEP_KEYS if values.get(k) is not None]
        if rate := values.get("tokens_per_sec"):
            share = (
                f", this member's: the step's {rate * self.members / 1000:.1f}k over its "
                f"{self.members} members"
                if self.members > 1
                else ""
            )
            parts.append(f"{rate / 1000:.1f}k tokens/s (positions{share})")
        elapsed = time.perf_counter() - self._started
        parts.append(f"{_duration(elapsed)} elapsed")
        if step > self._first:
            parts.append(f"{_duration(elapsed / (step - self._first) * (self.total - step))} left")
        self.log(f"step {step}/{self.total}: " + ", ".join(parts))

    def evaluated(self, step: int, values: dict, over: str) -> None:
        """An evaluation's metrics at ``step``: those over validation tokens (``over`` says
        which), then those of greedy decoding over ``eval_decoded_examples`` examples."""
        # A mixture's per-source eval_tokens/<name> stay listed: each says what its source's
        # metrics are over; the decoded counts are said with the decoding.
        hidden = [k for k in values if k in _COUNTS or _metric(k) == "eval_decoded_examples"]
        shown = {k: v for k, v in values.items() if v is not None and k not in hidden}
        line = f"eval at step {step} ({over}): " + _listed(
            shown, lambda k: _metric(k) not in DECODED
        )
        if any(_metric(k) in DECODED for k in shown):
            counts = {k: v for k, v in values.items() if _metric(k) == "eval_decoded_examples"}
            sources = ", ".join(f"{k.split('/')[1]} {v:,}" for k, v in counts.items() if "/" in k)
            line += f"; greedy decoding of {sum(counts.values()):,} validation examples"
            line += f" ({sources}): " if sources else ": "
            line += _listed(shown, lambda k: _metric(k) in DECODED)
        self.say(line)

    def tasks_scored(self, step: int, values: dict) -> None:
        """The downstream tasks' metrics at ``step`` (``task/<name>/<metric>``), each task's
        with what they are over (its ``examples`` or ``tokens``)."""
        tasks: dict[str, dict] = {}
        for key, value in values.items():
            _, name, metric = key.split("/", 2)
            tasks.setdefault(name, {})[metric] = value
        parts = []
        for name, metrics in tasks.items():
            unit = next(unit for unit in UNITS if unit in metrics)
            count = metrics.pop(unit)
            scores = ", ".join(f"{metric} {value:.4g}" for metric, value in metrics.items())
            parts.append(f"{name} {scores} (over {count:,} {unit})")
        self.say(f"tasks at step {step}: " + "; ".join(parts))

    def say(self, message: str) -> None:
        """A line of its own, above the bar if there is one."""
        if self._bar is None:
            self.log(message)
            return
        with self._bar.external_write_mode():
            self.log(message)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def _metric(key: str) -> str:
    """A key's metric: a mixture's source's ``eval_loss/<name>`` is an ``eval_loss``."""
    return key.split("/")[0]


def _listed(values: dict, keep) -> str:
    return ", ".join(f"{k} {v:.4g}" for k, v in values.items() if keep(k))


def _duration(seconds: float) -> str:
    return str(datetime.timedelta(seconds=round(seconds)))
