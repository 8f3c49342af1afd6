"""Shared by the decoding tests (tests/test_decode*.py): tiny models with weights scaled up
and greedy references by full forward passes without a cache."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from flaxformer_lite.models import ModelConfig, build_model

VOCAB = 64
SMALL = dict(
    d_model=32,
    num_heads=4,
    d_ff=64,
    vocab_size=VOCAB,
    max_length=32,
    embedding_dropout=0.0,
    attention_dropout=0.0,
    residual_dropout=0.0,
)

NEW = 7  # tokens each test generates
SOURCES = np.random.default_rng(1).integers(3, VOCAB, (3, 7)).astype(np.int32)


def make(preset, **overrides):
    """A tiny model in eval mode with weights scaled up, so greedy outputs vary from step to
    step instead of repeating one token (a stronger check of the cache)."""
    cfg = ModelConfig.from_preset(preset, **{**SMALL, **overrides})
    model = build_model(cfg, rngs=nnx.Rngs(jax.random.key(0, impl="rbg")))
    model.eval()
    params = nnx.state(model, nnx.Param)
    nnx.update(model, jax.tree.map(lambda x: x * 3, params))
    return model


@functools.partial(jax.jit, static_argnums=0)
def _lm_logits(graphdef, state, tokens):
    return nnx.merge(graphdef, state)(tokens)


def lm_logits(model, tokens):
    return _lm_logits(*nnx.split(model), jnp.asarray(tokens))


def clear_argmax(logits) -> int:
    """The argmax of ``logits [V]``, checked to lead the runner-up by far more than float32
    round-off: the references are compared token for token with the cached decoding, another
    program that sums in another order, where a near-tie could go either way."""
    runner_up, best = np.sort(np.asarray(logits, np.float64))[-2:]
    assert best - runner_up > 1e-4 * max(1.0, abs(best)), f"near-tie: {best} vs {runner_up}"
    return int(np.argmax(logits))


def greedy_reference(model, prompt, new_tokens):
    """Greedy continuation of one prompt by full forward passes (no cache)."""
    length = len(prompt) + new_tokens
    buffer = np.zeros((1, length), np.int32)
    buffer[0, : len(prompt)] = prompt
    for position in range(len(prompt), length):
        logits = lm_logits(model, buffer)[0, position - 1]
        buffer[0, position] = clear_argmax(logits)
    return buffer[0]


LM_CONFIGS = {
    "learned": ("gpt2-tiny", {}),
    "rope_gqa": ("llama-tiny", {"num_kv_heads": 2}),
    "alibi_scan": ("gpt2-tiny", {"positions": "alibi", "scan_layers": True}),
    "relative": ("gpt2-tiny", {"positions": "relative"}),
}
