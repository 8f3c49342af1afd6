"""What the parallel tests share: a tiny GPT-2 with its optimizer, and state helpers."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from flaxformer_lite.models import ModelConfig, build_model

# The overrides of a train.py run on every mesh: the default run's gpt2-tiny with one layer,
# dropout on: the byte tokenizer's 260 ids divide by the tensor sizes 4 and 2 (not 8), and its
# heads, d_ff and d_model divide over every mesh the tests use. A constant learning rate: a
# run's losses do not depend on train.steps.
E2E = [
    "model.num_decoder_layers=1",
    "train.batch_size=8",
    "data.seq_len=32",
    "optimizer.warmup_steps=0",
    "optimizer.schedule=constant",
    "train.log_every=5",
    "train.eval_every=1000",
    "train.eval_batches=1",
    "data.eval_size=16",
]

# A tiny GPT-2 (2 layers, d_model 64, 4 heads, d_ff 256, dropout on) with a vocabulary and
# length that divide over every mesh the tests use.
TINY = dict(vocab_size=64, max_length=16)
B, T = 8, 16


def tiny(seed=0, **overrides):
    """``(cfg, create)``: ``create()`` builds the model and its adamw ``nnx.Optimizer``."""
    cfg = ModelConfig.from_preset("gpt2-tiny", **{**TINY, **overrides})
    tx = optax.adamw(1e-2)  # one transformation: equal graphdefs from every call

    def create():
        model = build_model(cfg, rngs=nnx.Rngs(params=seed, dropout=seed + 1))
        return model, nnx.Optimizer(model, tx, wrt=nnx.Param)

    return cfg, create


def flat(state):
    """``{path: Variable}`` of an nnx.State."""
    return dict(nnx.to_flat_state(state))


def key_free(tree):
    """``to_savable``-style numpy copy: typed PRNG keys as their key data."""

    def leaf(x):
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        return np.asarray(x)

    return jax.tree.map(leaf, nnx.to_pure_dict(tree) if isinstance(tree, nnx.State) else tree)
