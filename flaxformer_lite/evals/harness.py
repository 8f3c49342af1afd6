"""Our model in lm-evaluation-harness (the ``lm-eval`` extra): ``flaxformer_lite``, an
``lm_eval.api.model.LM`` over a run directory or a Hugging Face checkpoint, so that any lm-eval
task, local files included (``dataset_path: json``, ``dataset_kwargs: {data_files: ...}``),
scores our model as it scores its own::

    python -m flaxformer_lite.evals.harness --model flaxformer_lite \\
        --model_args run_dir=runs/shakespeare --tasks my_task --include_path tasks/

lm-eval 0.4 finds only the models it ships or that a program registered before it reads its
flags (it has no plugin entry point), so this module registers ``flaxformer_lite`` and then runs
lm-eval's own command line, every flag as ``lm_eval`` takes it. From Python::

    import flaxformer_lite.evals.harness  # registers the model
    lm_eval.simple_evaluate(model="flaxformer_lite", model_args="run_dir=runs/x", tasks=[...])

``model_args``: ``run_dir`` (with ``step``, default the newest) or ``hf_dir`` (with a PEFT
LoRA ``adapter`` of it); ``max_length``,
the positions a request is cut to from the left (default the model's ``max_length``, as lm-eval's
Hugging Face model reads its ``n_positions``); ``trust_code`` for a run with code of its own.
``batch_size`` is the rows of one scoring batch (``auto``: 16). The log-likelihoods are those of
``flaxformer-lite evaluate`` and of a run's ``evals`` (:mod:`flaxformer_lite.evals`): one
implementation, held to lm-eval's Hugging Face model on our export by the tests.
"""

from __future__ import annotations

import itertools
import sys

import lm_eval.models  # noqa: F401  lm-eval's own models: it lists them only in an empty registry
import numpy as np
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

from flaxformer_lite.evals.config import DEFAULT_ROWS
from flaxformer_lite.evals.requests import encode_pair, rolling_requests, text_ids
from flaxformer_lite.evals.score import Scorer


@register_model("flaxformer_lite")
class FlaxformerLM(LM):
    """A decoder LM of ours as lm-eval's ``LM``: ``loglikelihood``, ``loglikelihood_rolling``
    and ``generate_until`` (greedy unless a task asks ``do_sample`` with a ``temperature``)."""

    def __init__(
        self,
        run_dir: str | None = None,
        hf_dir: str | None = None,
        step: int | None = None,
        max_length: int | None = None,
        batch_size: int | str | None = None,
        trust_code: bool = False,
        adapter: str | None = None,
        **lm_eval_options,  # device, max_batch_size: lm-eval's, for its own models
    ):
        super().__init__()
        from flaxformer_lite.train.trained_run import load_decoder

        self.model, self.tokenizer = load_decoder(
            run_dir=run_dir,
            hf_dir=hf_dir,
            step=step,
            trust_code=trust_code,
            who="lm-eval",
            adapter=adapter,
        )
        self.length = int(max_length or self.model.config.max_length)
        self.rows = _rows(batch_size)
        self.scorer = Scorer(rows=self.rows, length=self.length)

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """Each ``(context, continuation)``'s log-likelihood and whether it is greedy.

        Raises:
          ValueError: a continuation longer than ``max_length`` tokens (lm-eval's Hugging
            Face model would score the wrong positions).
        """
        scored = [encode_pair(self.tokenizer, *request.args) for request in requests]
        loglikelihood, greedy = self.scorer(self.model, scored)
        return [(float(a), bool(b)) for a, b in zip(loglikelihood, greedy, strict=True)]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each text's tokens (``<sos>`` first where the tokenizer starts inputs with it) after
        a ``<sos>``, in windows of ``max_length``."""
        windows, owners = [], []
        for number, request in enumerate(requests):
            (text,) = request.args
            ids = text_ids(self.tokenizer, text)  # as lm-eval's Hugging Face model's tok_encode
            parts = rolling_requests(ids, self.tokenizer.sos_id, self.length)
            windows += parts
            owners += [number] * len(parts)
        loglikelihood, _ = self.scorer(self.model, windows)
        totals = np.bincount(owners, weights=loglikelihood, minlength=len(requests))
        return [float(total) for total in totals]

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        from flaxformer_lite.decode.text import continue_in_windows

        answers: list[str | None] = [None] * len(requests)
        settings = [_generation(request.args[1]) for request in requests]
        order = sorted(range(len(requests)), key=lambda i: repr(settings[i]))
        for setting, group in itertools.groupby(order, key=lambda i: settings[i]):
            until, max_new, temperature, seed = setting
            group = list(group)
            for start in range(0, len(group), self.rows):
                batch = group[start : start + self.rows]
                context = min(self.length, self.model.config.max_length)
                room = max(1, context - max_new)  # lm-eval keeps max_gen_toks free
                rows = [list(text_ids(self.tokenizer, requests[i].args[0]))[-room:] for i in batch]
                sampling = {}
                if temperature > 0:
                    import jax

                    sampling = {"temperature": temperature, "rng": jax.random.key(seed)}
                written = continue_in_windows(
                    self.model, self.tokenizer, rows, max_new_tokens=max_new, **sampling
                )
                for index, ids in zip(batch, written, strict=True):
                    answers[index] = _cut(self.tokenizer.decode(ids), until)
        return answers


def _rows(batch_size: int | str | None) -> int:
    """The rows of a batch from lm-eval's ``--batch_size`` (text on its command line): a
    positive number, or ``auto`` / ``auto:N`` / none for :data:`~.config.DEFAULT_ROWS`.

    Raises:
      ValueError: anything else.
    """
    if batch_size is None or str(batch_size).startswith("auto"):
        return DEFAULT_ROWS
    try:
        rows = int(batch_size)
    except ValueError:
        rows = 0
    if rows < 1:
        raise ValueError(f"batch_size must be a positive number or auto, got {batch_size!r}")
    return rows


def _generation(options: dict) -> tuple[tuple[str, ...], int, float, int]:
    """``(until, max_gen_toks, temperature, seed)`` of a request's generation options, as
    lm-eval's Hugging Face model reads them (greedy unless ``do_sample``)."""
    until = options.get("until") or ()
    until = (until,) if isinstance(until, str) else tuple(until)
    temperature = float(options.get("temperature") or 0.0) if options.get("do_sample") else 0.0
    return until, int(options.get("max_gen_toks", 256)), temperature, int(options.get("seed", 0))


def _cut(text: str, until: tuple[str, ...]) -> str:
    """``text`` up to the first of the ``until`` strings."""
    for stop in until:
        if stop:
            text = text.split(stop, 1)[0]
    return text


def main(argv: list[str] | None = None) -> int:
    """lm-eval's command line with ``flaxformer_lite`` registered."""
    import multiprocessing

    from lm_eval.__main__ import cli_evaluate

    from flaxformer_lite.process import skip_absent_tpu

    skip_absent_tpu()  # a command of ours: it chooses the backends as the others do
    # lm-eval's bootstrapped standard errors run in a process pool; a forked child of this
    # process, which holds JAX's threads, may deadlock.
    multiprocessing.set_start_method("spawn", force=True)
    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    cli_evaluate()
    return 0


if __name__ == "__main__":
    sys.exit(main())
