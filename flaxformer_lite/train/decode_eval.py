"""Evaluation by decoding: the model writes answers (LM prompts) or targets (seq2seq sources) for
validation examples, which are scored as text. Here are which examples and prompts, and the
scores; the writing is :mod:`flaxformer_lite.decode.text`'s, as for ``flaxformer-lite generate``.

* exact match: the synthetic generator's scoring (``Generator.score``), else stripped
  string equality;
* token accuracy: the fraction of reference tokens (and the closing ``<eos>``) that the greedy
  output reproduces at the same position;
* BLEU (sacrebleu's corpus BLEU) for translation data (a ``parallel`` source).

Plain text has no answer to score: :func:`continue_texts` samples continuations of validation
prompts, to be read.

Perplexity is ``exp(eval_loss)`` of the teacher-forced evaluation (see ``train.loop``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax

from flaxformer_lite.data import TEXT_RECORDS, Generator, Task, Tokenizer, split_prompt
from flaxformer_lite.decode import until_eos
from flaxformer_lite.decode.text import new_tokens, prompt_ids, source_ids


@dataclasses.dataclass(frozen=True)
class Sample:
    """One decoded example: what the model read, what it should write, and what it wrote."""

    input: str
    reference: str
    prediction: str


def decodable(task: Task, examples: Sequence[dict]) -> bool:
    """Whether ``examples`` of a ``task`` run can be scored by decoding: seq2seq data, or LM data
    of the synthetic prompt=answer generators (plain text has no answer to compare with)."""
    if not task.decodes:
        return False
    prompted = isinstance(examples, Generator) and examples.records == TEXT_RECORDS
    return prompted or not task.continues


def decode_eval(
    model,
    tokenizer: Tokenizer,
    examples: Sequence[dict],
    *,
    task: Task,
    num_examples: int,
    max_length: int,
) -> tuple[dict[str, float], list[Sample]]:
    """Greedy-decodes the first ``num_examples`` validation ``examples`` and scores them.

    Args:
      model: a ``DecoderLM`` (task ``lm``) or ``EncoderDecoder`` (task ``seq2seq``).
      tokenizer: the run's tokenizer.
      examples: validation records (a synthetic ``Generator`` or a list of dicts); see
        :func:`decodable`.
      num_examples: how many to decode (one batch, the same every call: one compile).
      max_length: the model's longest sequence (prompt plus answer, or one target).

    Returns:
      ``({"eval_exact_match", "eval_token_accuracy"[, "eval_bleu"]}, samples)``.
    """
    continues = task.continues  # a decoder LM, else an encoder-decoder
    records = [examples[i] for i in range(min(num_examples, len(examples)))]
    if continues:
        pairs = [split_prompt(r["text"]) for r in records]
        inputs = [prompt_ids(tokenizer, prompt) for prompt, _ in pairs]
    else:
        pairs = [(r["source"], r["target"]) for r in records]
        inputs = [source_ids(tokenizer, source, max_length) for source, _ in pairs]
    encode = tokenizer.encode if continues else tokenizer.encode_target
    references = [[*encode(reference), tokenizer.eos_id] for _, reference in pairs]
    budget = max_length - max(map(len, inputs)) if continues else max_length - 1
    max_new_tokens = max(1, min(max(len(r) for r in references) + 2, budget))
    outputs = new_tokens(model, tokenizer, inputs, max_new_tokens=max_new_tokens)
    predictions = [tokenizer.decode(until_eos(ids, tokenizer.eos_id)) for ids in outputs]
    samples = [
        Sample(input=source, reference=reference, prediction=prediction)
        for (source, reference), prediction in zip(pairs, predictions, strict=True)
    ]
    metrics = {
        "eval_exact_match": _exact_match(examples, records, predictions, pairs),
        "eval_token_accuracy": token_accuracy(outputs, references),
    }
    if not continues and not isinstance(examples, Generator):
        import sacrebleu  # imported here: only translation data is scored by it

        metrics["eval_bleu"] = sacrebleu.corpus_bleu(
            predictions, [[reference for _, reference in pairs]]
        ).score
    return metrics, samples


def token_accuracy(outputs: Sequence[Sequence[int]], references: Sequence[Sequence[int]]) -> float:
    """Reference tokens matched at their position by the output, over all reference tokens."""
    hits = total = 0
    for output, reference in zip(outputs, references, strict=True):
        output = list(output)[: len(reference)]
        hits += sum(o == r for o, r in zip(output, reference, strict=False))
        total += len(reference)
    return hits / max(total, 1)


def _exact_match(examples, records, predictions, pairs) -> float:
    if isinstance(examples, Generator) and examples.metric == "exact_match":
        return examples.score(predictions, records)["exact_match"]
    hits = sum(p.strip() == r.strip() for p, (_, r) in zip(predictions, pairs, strict=True))
    return hits / len(predictions)


def continue_texts(
    model,
    tokenizer: Tokenizer,
    examples: Sequence[dict],
    *,
    num_samples: int,
    max_length: int,
    rng: jax.Array,
    temperature: float = 0.8,
) -> list[Sample]:
    """Sampled continuations (``temperature``, key ``rng``) of prompts from the validation
    texts ``examples`` (dicts with ``text``): the start of each of the first ``num_samples``
    texts, or, with fewer texts, line starts spread over the first one. A prompt is a quarter of
    ``max_length`` tokens, and the continuation fills the rest. ``reference`` is left empty."""
    prompt_length = max(1, max_length // 4)
    prompts = []
    for text, offset in _prompt_starts(examples, num_samples):
        head = [tokenizer.sos_id] if offset == 0 else []
        ids = tokenizer.encode(text[offset : offset + 8 * prompt_length])
        prompts.append([*head, *ids][:prompt_length])
    outputs = new_tokens(
        model,
        tokenizer,
        prompts,
        max_new_tokens=max(1, max_length - max(map(len, prompts))),
        temperature=temperature,
        rng=rng,
    )
    return [
        Sample(
            input=tokenizer.decode(prompt),
            reference="",
            prediction=tokenizer.decode(until_eos(ids, tokenizer.eos_id)),
        )
        for prompt, ids in zip(prompts, outputs, strict=True)
    ]


def _prompt_starts(examples: Sequence[dict], count: int) -> list[tuple[str, int]]:
    """``(text, character offset)`` of ``count`` prompts: the first ``count`` texts' starts, or
    line starts spread evenly over the first text when there are fewer texts."""
    texts = [examples[i]["text"] for i in range(min(count, len(examples)))]
    if len(texts) >= count or not texts:
        return [(text, 0) for text in texts]
    text = texts[0]
    starts = []
    for k in range(count):
        offset = text.rfind("\n", 0, k * len(text) // count) + 1
        starts.append((text, offset))
    return starts
