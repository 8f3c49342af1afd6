"""Tests for flaxformer_lite.models: the properties the three architectures must keep.

Causality, padding invariance, the KV cache against the full forward pass, packed sequences,
scan vs loop layers, rematerialization, bf16 compute, dropout, continuous inputs and
classification, on tiny models.

Compiling is nearly all the cost of these tests, so:

* every model call goes through a few module-level functions jitted by :func:`jit_nodes`,
  which compiles with XLA's backend optimizations off (about 40% less compile time on CPU; the
  programs compute the same values);
* inputs share shapes (batch 2, length 8), and two models of one config have equal graph
  definitions, so they share a compiled program;
* parameters are drawn with the ``rbg`` PRNG, whose initializers compile several times faster
  than threefry's (the dropout test keeps the default ``nnx.Rngs(params=0, dropout=1)``).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from flaxformer_lite import ops
from flaxformer_lite.models import (
    Encoder,
    EncoderDecoder,
    ModelConfig,
    TransformerLayer,
    build_model,
)
from flaxformer_lite.nn.mlp import MLP
from flaxformer_lite.nn.stack import stack_layer_states

pytestmark = pytest.mark.fast_compile  # XLA's backend optimizations off: conftest.py

VOCAB = 64
B, T = 2, 8  # the batch and length of most inputs
SMALL = dict(d_model=32, num_heads=4, d_ff=64, vocab_size=VOCAB, max_length=32)
NO_DROPOUT = dict(embedding_dropout=0.0, attention_dropout=0.0, residual_dropout=0.0)


def tiny(preset, **overrides):
    """A CPU-sized preset, dropout off unless overridden."""
    return ModelConfig.from_preset(preset, **{**SMALL, **NO_DROPOUT, **overrides})


def make(cfg, rngs=0, *, train=False):
    """``build_model(cfg)`` in eval mode; an int ``rngs`` seeds an rbg key."""
    if isinstance(rngs, int):
        rngs = nnx.Rngs(jax.random.key(rngs, impl="rbg"))
    model = build_model(cfg, rngs=rngs)
    if train:
        model.train()
    else:
        model.eval()
    return model


def tokens(shape, seed=0):
    return jnp.asarray(np.random.default_rng(seed).integers(0, VOCAB, shape), jnp.int32)


def lengths_mask(lengths, length):
    return jnp.asarray(np.arange(length)[None, :] < np.asarray(lengths)[:, None])


def perturb(x, index, seed=1):
    """``x`` with every row's entry ``index`` (axis 1) changed."""
    x = np.array(x)
    if x.dtype.kind in "iu":
        x[:, index] = (x[:, index] + 1 + np.arange(len(x))) % VOCAB
    else:
        x[:, index] += np.random.default_rng(seed).normal(size=x[:, index].shape)
    return jnp.asarray(x)


def assert_close(actual, expected, atol=1e-5, rtol=1e-5):
    np.testing.assert_allclose(np.asarray(actual), np.asarray(expected), atol=atol, rtol=rtol)


def max_diff(a, b, axis=None):
    return np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32)).max(axis=axis)


# ------------------------------------------------------------------ jitted entry points


def jit_nodes(fn=None, *, num_nodes=1):
    """Like ``nnx.jit`` for ``fn(*nodes, *arrays)``, whose first ``num_nodes`` arguments are
    NNX objects (models, optimizers); their state updates (KV caches, rng counts, parameters)
    are written back. Compiled without XLA's backend optimizations: faster to compile."""
    if fn is None:
        return functools.partial(jit_nodes, num_nodes=num_nodes)

    @functools.partial(
        jax.jit, static_argnums=0, compiler_options={"xla_backend_optimization_level": 0}
    )
    def pure(graphdef, state, args):
        nodes = nnx.merge(graphdef, state)
        out = fn(*nodes, *args)
        return out, nnx.state(nodes)

    @functools.wraps(fn)
    def call(*args):
        nodes = args[:num_nodes]
        graphdef, state = nnx.split(nodes)
        out, new_state = pure(graphdef, state, args[num_nodes:])
        nnx.update(nodes, new_state)
        return out

    return call


@jit_nodes
def lm_forward(model, inputs, positions=None, segment_ids=None, padding_mask=None):
    return model(inputs, positions=positions, segment_ids=segment_ids, padding_mask=padding_mask)


@jit_nodes
def lm_decode(model, inputs, positions=None, padding_mask=None):
    return model(inputs, positions=positions, padding_mask=padding_mask, decode=True)


@jit_nodes
def enc_forward(model, inputs, padding_mask=None):
    return model(inputs, padding_mask=padding_mask)


@jit_nodes
def enc_classify_and_encode(model, inputs, padding_mask=None):
    return (
        model.classify(inputs, padding_mask=padding_mask),
        model.encode(inputs, padding_mask=padding_mask),
    )


@jit_nodes
def ed_forward(model, src, tgt, padding_mask=None):
    return model(src, tgt, padding_mask=padding_mask)


@jit_nodes
def ed_encode(model, src, padding_mask=None):
    return model.encode(src, padding_mask=padding_mask)


@jit_nodes
def ed_decode_step(model, tgt, encoded, padding_mask=None):
    return model.decode(tgt, encoded, padding_mask=padding_mask, decode=True)


def lm_loss(model, toks):
    return ops.cross_entropy(model(toks[:, :-1]), toks[:, 1:])[0]


def lm_mse(model, x, y):
    return jnp.mean((model(x) - y) ** 2)


def ed_mse(model, src, tgt, y):
    return jnp.mean((model(src, tgt) - y) ** 2)


def train_step_for(loss_fn):
    """One optimizer step on ``loss_fn(model, *batch)``; returns the loss *before* the step."""

    @jit_nodes(num_nodes=2)
    def step(model, optimizer, *batch):
        loss, grads = nnx.value_and_grad(loss_fn)(model, *batch)
        optimizer.update(model, grads)
        return loss

    return step


lm_train_step = train_step_for(lm_loss)
MSE_STEPS = {
    "decoder": train_step_for(lm_mse),
    "encoder": train_step_for(lm_mse),
    "encoder_decoder": train_step_for(ed_mse),
}


@jit_nodes
def lm_logits_loss_and_grads(model, toks):
    def loss_fn(m):
        logits = m(toks[:, :-1])
        return ops.cross_entropy(logits, toks[:, 1:])[0], logits

    (loss, logits), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
    return logits, loss, grads


def adam(model, lr=1e-2):
    return nnx.Optimizer(model, optax.adam(lr), wrt=nnx.Param)


# ------------------------------------------------------------------ property checks


def check_causal(forward, inputs, positions_to_change=(2, 5)):
    """Changing input ``k`` leaves outputs ``< k`` alone and changes every output ``>= k``."""
    base = np.asarray(forward(inputs))
    for k in positions_to_change:
        changed = np.asarray(forward(perturb(inputs, k)))
        assert_close(changed[:, :k], base[:, :k], atol=1e-6, rtol=0)
        per_position = max_diff(changed[:, k:], base[:, k:], axis=(0, 2))
        assert (per_position > 1e-6).all(), f"input {k} does not reach {per_position}"


def check_position_shift(model, x, absolute):
    """Shifting every position by 3 changes the logits of absolute schemes (sinusoidal, learned)
    and leaves relative ones (rope, relative buckets, alibi, none) unchanged."""
    ones = jnp.ones((B, T), jnp.int32)  # one segment: the same program as check_packing's
    base = lm_forward(model, x, jnp.arange(T)[None].repeat(B, 0), ones)
    shifted = lm_forward(model, x, 3 + jnp.arange(T)[None].repeat(B, 0), ones)
    if absolute:
        assert (max_diff(shifted, base, axis=(0, 2)) > 1e-6).all()
    else:
        assert_close(shifted, base, atol=1e-4)


def check_incremental_decoding(model, x, full, prefix=4):
    """A prefix, then one token at a time through the KV cache == the full forward pass."""
    model.init_cache(B, 16)
    steps = [lm_decode(model, x[:, :prefix])]
    steps += [lm_decode(model, x[:, i : i + 1]) for i in range(prefix, x.shape[1])]
    assert_close(jnp.concatenate(steps, axis=1), full, atol=1e-5)


def check_ragged_decoding(model, x, full, prompt_lengths=(5, 2), width=5):
    """Left-padded prompts with a padding mask and per-row positions, then per-row steps:
    each row's logits equal its own unpadded forward pass (``full``, row ``r`` from position 0;
    causality keeps the tokens after a row's end out of its logits)."""
    lengths = np.asarray(prompt_lengths)
    x, full = np.asarray(x), np.asarray(full)
    prompt = np.zeros((B, width), np.int32)
    positions = np.zeros((B, width), np.int32)
    for row, n in enumerate(lengths):
        prompt[row, width - n :] = x[row, :n]
        positions[row, width - n :] = np.arange(n)
    mask = jnp.asarray(np.arange(width)[None] >= width - lengths[:, None])
    model.init_cache(B, 16)
    out = np.asarray(lm_decode(model, jnp.asarray(prompt), jnp.asarray(positions), mask))
    for row, n in enumerate(lengths):
        assert_close(out[row, width - n :], full[row, :n])
    ones = jnp.ones((B, 1), bool)
    for step in range(x.shape[1] - lengths.max()):
        index = lengths + step
        token = jnp.asarray(x[np.arange(B), index][:, None])
        out = np.asarray(lm_decode(model, token, jnp.asarray(index[:, None]), ones))
        for row in range(B):
            assert_close(out[row, 0], full[row, index[row]])


def check_packing(model, x, packing=((3, 5), (2, 4, 2))):
    """Packed segments (segment ids, positions restarting at 0) == each segment run alone."""
    x = np.asarray(x)
    segment_ids = np.zeros((B, T), np.int32)
    positions = np.zeros((B, T), np.int32)
    alone, spans = [], []
    for row, sizes in enumerate(packing):
        start = 0
        for segment, size in enumerate(sizes):
            segment_ids[row, start : start + size] = segment + 1
            positions[row, start : start + size] = np.arange(size)
            # The segment alone at the start of a row, right-filled (causality: filler unseen).
            alone.append(np.concatenate([x[row, start : start + size], np.full(T - size, 7)]))
            spans.append((row, start, size))
            start += size
    packed = np.asarray(
        lm_forward(model, jnp.asarray(x), jnp.asarray(positions), jnp.asarray(segment_ids))
    )
    alone += [alone[-1]] * (-len(alone) % B)
    separate = np.concatenate(
        [
            np.asarray(lm_forward(model, jnp.asarray(np.stack(alone[i : i + B]), jnp.int32)))
            for i in range(0, len(alone), B)
        ]
    )
    for i, (row, start, size) in enumerate(spans):
        assert_close(packed[row, start : start + size], separate[i, :size])


# ------------------------------------------------------------------ DecoderLM: causality, cache

ALL_CHECKS = ("cache", "ragged", "packing")


@pytest.mark.parametrize(
    "preset, overrides, checks",
    [
        ("gpt2-tiny", dict(positions="sinusoidal"), ("packing",)),
        ("gpt2-tiny", dict(positions="learned"), ALL_CHECKS),
        ("llama-tiny", dict(positions="rope"), ALL_CHECKS),  # GQA: 4 query heads, 2 kv heads
        ("gpt2-tiny", dict(positions="relative"), ALL_CHECKS),
        ("gpt2-tiny", dict(positions="alibi"), ALL_CHECKS),
        ("gpt2-tiny", dict(positions="none"), ("packing",)),
        ("gpt2-tiny", dict(positions="learned", scan_layers=True), ("cache", "ragged")),
    ],
    ids=["sinusoidal", "learned", "rope-gqa", "relative", "alibi", "none", "learned-scan"],
)
def test_decoder_lm_causality_cache_and_packing(preset, overrides, checks):
    cfg = tiny(preset, **overrides)
    if preset == "llama-tiny":
        assert cfg.num_kv_heads < cfg.num_heads
    model = make(cfg)
    x = tokens((B, T))
    full = lm_forward(model, x)
    assert full.shape == (B, T, VOCAB)

    def forward(inputs):
        return lm_forward(model, inputs)

    check_causal(forward, x)
    if "packing" in checks:  # before init_cache, which changes the graph (a recompile)
        check_packing(model, x)
        check_position_shift(model, x, absolute=cfg.positions in ("sinusoidal", "learned"))
    if "cache" in checks:
        check_incremental_decoding(model, x, full)
    if "ragged" in checks:
        check_ragged_decoding(model, x, full)


# ------------------------------------------------------------------ EncoderDecoder


@pytest.mark.parametrize("positions, scan", [("sinusoidal", False), ("relative", True)])
def test_encoder_decoder_causality_and_decoding(positions, scan):
    model = make(tiny("transformer-tiny", positions=positions, scan_layers=scan))
    src, tgt = tokens((B, T + 1), seed=3), tokens((B, T))
    src_mask = lengths_mask([T + 1, 4], T + 1)
    full = ed_forward(model, src, tgt, src_mask)
    assert full.shape == (B, T, VOCAB)
    check_causal(lambda t: ed_forward(model, src, t, src_mask), tgt)

    encoded = ed_encode(model, src, src_mask)
    model.init_cache(B, T)
    steps = [ed_decode_step(model, tgt[:, i : i + 1], encoded, src_mask) for i in range(T)]
    assert_close(jnp.concatenate(steps, axis=1), full, atol=1e-5)


def test_encoder_decoder_ignores_padded_source():
    model = make(tiny("transformer-tiny"))
    src, tgt, lengths = np.asarray(tokens((B, T + 1), seed=3)), tokens((B, T)), [T + 1, 4]
    src_mask = lengths_mask(lengths, T + 1)
    base = np.asarray(ed_forward(model, jnp.asarray(src), tgt, src_mask))

    other = src.copy()
    other[1, 4:] = (other[1, 4:] + 9) % VOCAB
    assert_close(ed_forward(model, jnp.asarray(other), tgt, src_mask), base)

    longer = np.concatenate([src, np.full((B, 3), 1)], axis=1)
    assert_close(ed_forward(model, jnp.asarray(longer), tgt, lengths_mask(lengths, T + 4)), base)

    # ... while a real source token reaches every target position.
    out = ed_forward(model, perturb(src, 2), tgt, src_mask)
    assert (max_diff(out, base, axis=(0, 2)) > 1e-6).all()


def test_decoding_past_the_cache_gives_nan_not_wrong_numbers():
    model = make(tiny("gpt2-tiny"))
    model.init_cache(B, 6)
    x = tokens((B, T))
    assert np.isfinite(np.asarray(lm_decode(model, x[:, :4]))).all()
    assert np.isnan(np.asarray(lm_decode(model, x[:, 4:7]))).all()  # slots 4..6 of 0..5


def test_encoder_decoder_target_longer_than_source_without_mask():
    model = make(tiny("transformer-tiny"))
    out = ed_forward(model, tokens((B, 3)), tokens((B, 5)))
    assert out.shape == (B, 5, VOCAB)


# ------------------------------------------------------------------ Encoder padding


@pytest.mark.parametrize("positions", ["learned", "relative", "alibi"])
def test_encoder_ignores_padding(positions):
    model = make(tiny("bert-tiny", positions=positions))
    toks, lengths = np.asarray(tokens((B, T))), [T, 5]
    mask = lengths_mask(lengths, T)
    base = np.asarray(enc_forward(model, jnp.asarray(toks), mask))
    assert base.shape == (B, T, VOCAB)

    other = toks.copy()
    other[1, 5:] = (other[1, 5:] + 7) % VOCAB  # padding ids change
    out = np.asarray(enc_forward(model, jnp.asarray(other), mask))
    for row, n in enumerate(lengths):
        assert_close(out[row, :n], base[row, :n])

    longer = np.concatenate([toks, np.full((B, 3), 5)], axis=1)  # three more padded positions
    out = np.asarray(enc_forward(model, jnp.asarray(longer), lengths_mask(lengths, T + 3)))
    for row, n in enumerate(lengths):
        assert_close(out[row, :n], base[row, :n])

    # ... while a real token is seen by every real position (bidirectional attention).
    out = np.asarray(enc_forward(model, perturb(toks, 3), mask))
    for row, n in enumerate(lengths):
        assert (max_diff(out[row, :n], base[row, :n], axis=-1) > 1e-6).all()


# ------------------------------------------------------------------ architecture variants


@pytest.mark.parametrize(
    "norm_position, positions, activation, parallel",
    [
        ("post", "sinusoidal", "relu", False),
        ("pre", "learned", "gelu", True),
        ("post", "rope", "swiglu", False),
        ("pre", "relative", "geglu", False),
        ("post", "alibi", "gelu_tanh", True),
        ("pre", "none", "swiglu", True),
    ],
)
def test_variant_trains(norm_position, positions, activation, parallel):
    cfg = tiny(
        "gpt2-tiny",
        norm_position=norm_position,
        positions=positions,
        activation=activation,
        parallel_block=parallel,
        num_decoder_layers=1,
    )
    model = make(cfg)
    optimizer = adam(model)
    toks = tokens((B, T + 1))
    before = float(lm_train_step(model, optimizer, toks))
    after = float(lm_train_step(model, optimizer, toks))
    assert np.isfinite(before) and after < before - 1e-3, (before, after)


def test_each_choice_changes_the_outputs():
    # Position schemes without parameters (sinusoidal, rope, alibi) get exactly the parameters
    # of the "none" base from the same rngs: only the scheme itself can change the logits.
    base = dict(norm_position="pre", activation="gelu_tanh", positions="none", num_decoder_layers=1)
    x = tokens((B, T))
    reference = lm_forward(make(tiny("gpt2-tiny", **base)), x)
    changes = [
        dict(norm_position="post"),
        dict(parallel_block=True),
        *(dict(activation=a) for a in ("relu", "gelu", "swiglu", "geglu")),
        *(dict(positions=p) for p in ("sinusoidal", "learned", "rope", "relative", "alibi")),
    ]
    for change in changes:
        out = lm_forward(make(tiny("gpt2-tiny", **{**base, **change})), x)
        # gelu vs its tanh approximation differ least, by ~1e-5 on these logits.
        assert max_diff(out, reference) > 1e-7, change


@pytest.mark.parametrize("activation", ["relu", "gelu", "gelu_tanh", "swiglu", "geglu"])
def test_mlp_activation_formula(activation):
    mlp = MLP(8, 16, activation=activation, rngs=nnx.Rngs(jax.random.key(0, impl="rbg")))
    x = np.random.default_rng(0).normal(size=(2, 3, 8)).astype(np.float32)
    act = {
        "relu": jax.nn.relu,
        "gelu": lambda h: jax.nn.gelu(h, approximate=False),
        "gelu_tanh": lambda h: jax.nn.gelu(h, approximate=True),
        "swiglu": jax.nn.silu,
        "geglu": lambda h: jax.nn.gelu(h, approximate=False),
    }[activation]
    up = x @ np.asarray(mlp.wi.kernel[...]) + np.asarray(mlp.wi.bias[...])
    if activation in ("swiglu", "geglu"):
        gate = x @ np.asarray(mlp.wi_gate.kernel[...]) + np.asarray(mlp.wi_gate.bias[...])
        hidden = np.asarray(act(gate)) * up
    else:
        assert mlp.wi_gate is None
        hidden = np.asarray(act(up))
    expected = hidden @ np.asarray(mlp.wo.kernel[...]) + np.asarray(mlp.wo.bias[...])
    assert_close(mlp(jnp.asarray(x)), expected, atol=1e-5)


@jit_nodes
def layer_and_reference(layer, x):
    """The layer's output and the formula for its norm placement, from its own sublayers."""

    def attn(h):
        return layer.self_attention(h, is_causal=True)

    n1, n2, mlp = layer.self_attention_norm, layer.mlp_norm, layer.mlp
    if layer.parallel and layer.pre_norm:
        expected = x + attn(n1(x)) + mlp(n1(x))
    elif layer.parallel:
        expected = n1(x + attn(x) + mlp(x))
    elif layer.pre_norm:
        h = x + attn(n1(x))
        expected = h + mlp(n2(h))
    else:
        h = n1(x + attn(x))
        expected = n2(h + mlp(h))
    return layer(x), expected


@pytest.mark.parametrize("norm_position", ["pre", "post"])
@pytest.mark.parametrize("parallel", [False, True])
def test_layer_norm_placement(norm_position, parallel):
    cfg = tiny("gpt2-tiny", norm_position=norm_position, parallel_block=parallel)
    layer = TransformerLayer(
        cfg,
        num_layers=2,
        causal=True,
        cross_attention=False,
        rngs=nnx.Rngs(jax.random.key(0, impl="rbg")),
    )
    layer.eval()
    assert (layer.mlp_norm is None) == parallel
    # Norm scales and biases away from (1, 0), so a norm in the wrong place shows.
    for i, norm in enumerate((layer.self_attention_norm, layer.mlp_norm)):
        if norm is not None:
            wave = np.sin(np.arange(cfg.d_model) + i).astype(np.float32)
            norm.scale[...] = jnp.asarray(1.0 + 0.5 * wave)
            norm.bias[...] = jnp.asarray(0.3 * wave)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(B, 6, cfg.d_model)), jnp.float32)
    out, expected = layer_and_reference(layer, x)
    assert_close(out, expected, atol=1e-5)


# ------------------------------------------------------------------ scan and remat


def copy_loop_into_scan(loop, scanned, towers):
    """Gives ``scanned`` (scan_layers=True) the parameters of ``loop`` (scan_layers=False)."""
    for name in towers:
        loop_tower, scan_tower = getattr(loop, name), getattr(scanned, name)
        per_layer = [nnx.state(layer, nnx.Param) for layer in loop_tower.layers.layers]
        nnx.update(scan_tower.layers.layers, stack_layer_states(per_layer))
        for part in ("relative_bias", "final_norm"):
            if getattr(loop_tower, part) is not None:
                nnx.update(getattr(scan_tower, part), nnx.state(getattr(loop_tower, part)))
    for part in ("embed", "src_embed", "tgt_embed", "head"):
        if hasattr(loop, part):
            nnx.update(getattr(scanned, part), nnx.state(getattr(loop, part), nnx.Param))


def test_scan_matches_loop_decoder_lm():
    cfg = tiny("gpt2-tiny", positions="relative")
    loop, scanned = make(cfg), make(cfg.replace(scan_layers=True), rngs=1)
    x = tokens((B, T))
    assert max_diff(lm_forward(scanned, x), lm_forward(loop, x)) > 1e-3  # different init
    copy_loop_into_scan(loop, scanned, ["decoder"])
    assert_close(lm_forward(scanned, x), lm_forward(loop, x), atol=1e-5)


def test_scan_matches_loop_encoder_decoder():
    cfg = tiny("transformer-tiny")
    loop, scanned = make(cfg), make(cfg.replace(scan_layers=True), rngs=1)
    src, tgt = tokens((B, T + 1), seed=3), tokens((B, T))
    copy_loop_into_scan(loop, scanned, ["encoder", "decoder"])
    assert_close(ed_forward(scanned, src, tgt), ed_forward(loop, src, tgt), atol=1e-5)


def test_remat_changes_nothing():
    x = tokens((B, T + 1))
    results = {
        remat: lm_logits_loss_and_grads(make(tiny("gpt2-tiny", remat=remat)), x)
        for remat in ("none", "full", "dots_saveable")
    }
    logits, loss, grads = results["none"]
    assert max(np.abs(g).max() for g in jax.tree.leaves(grads)) > 0
    for remat in ("full", "dots_saveable"):
        other_logits, other_loss, other_grads = results[remat]
        assert_close(other_logits, logits, atol=1e-6)
        assert_close(other_loss, loss, atol=1e-6)
        assert jax.tree.structure(other_grads) == jax.tree.structure(grads)
        jax.tree.map(lambda a, b: assert_close(a, b, atol=1e-6), other_grads, grads)


# ------------------------------------------------------------------ bf16


@pytest.mark.parametrize("preset", ["gpt2-tiny", "llama-tiny"])
def test_bfloat16_compute_close_to_float32(preset):
    x = tokens((B, T))
    reference = lm_forward(make(tiny(preset)), x)
    model = make(tiny(preset, dtype="bfloat16"))  # same rngs: the same float32 parameters
    assert {v.dtype for v in jax.tree.leaves(nnx.state(model, nnx.Param))} == {np.dtype(np.float32)}
    out = lm_forward(model, x)
    assert out.dtype == jnp.bfloat16
    error = max_diff(out, reference) / np.abs(np.asarray(reference)).max()
    assert 0 < error < 2e-2, error


# ------------------------------------------------------------------ dropout


def test_dropout_eval_deterministic_train_random_and_reproducible():
    cfg = ModelConfig.from_preset("gpt2-tiny", **SMALL)  # dropout 0.1 everywhere
    assert cfg.embedding_dropout and cfg.attention_dropout and cfg.residual_dropout
    x = tokens((B, T))

    def build(c):
        return make(c, nnx.Rngs(params=0, dropout=1))

    model, no_dropout = build(cfg), build(cfg.replace(**NO_DROPOUT))
    first = lm_forward(model, x)
    assert_close(lm_forward(model, x), first, atol=0, rtol=0)
    assert_close(first, lm_forward(no_dropout, x), atol=1e-6)

    model.train()
    train_1, train_2 = lm_forward(model, x), lm_forward(model, x)
    assert max_diff(train_1, train_2) > 1e-3
    assert max_diff(train_1, first) > 1e-3

    twin = build(cfg)
    twin.train()
    assert_close(lm_forward(twin, x), train_1, atol=1e-6)
    assert_close(lm_forward(twin, x), train_2, atol=1e-6)


# ------------------------------------------------------------------ continuous inputs


def series(batch, length, seed=0):
    """Sines: inputs [B, T, 3] (value, its cosine, time), targets the next step's two waves."""
    rng = np.random.default_rng(seed)
    t = np.arange(length + 1)[None, :] * 0.6 + rng.uniform(0, 6, (batch, 1))
    values = np.stack([np.sin(t), np.cos(t), t / 10], axis=-1).astype(np.float32)
    return jnp.asarray(values[:, :-1]), jnp.asarray(values[:, 1:, :2])


@pytest.mark.parametrize("preset", ["gpt2-tiny", "bert-tiny", "transformer-tiny"])
def test_continuous_inputs_and_regression_head(preset):
    layers = {
        k: min(v, 1)
        for k, v in ModelConfig.from_preset(preset).to_dict().items()
        if k in ("num_encoder_layers", "num_decoder_layers")
    }
    cfg = tiny(preset, input_dim=3, output_dim=2, tie_embeddings=False, output_bias=False, **layers)
    model = make(cfg)
    x, y = series(B, T)
    if isinstance(model, EncoderDecoder):
        # The decoder reads what it predicts: the current two waves, teacher-forced.
        out, batch = ed_forward(model, x, x[..., :2]), (x, x[..., :2], y)
    elif isinstance(model, Encoder):
        out, batch = enc_forward(model, x), (x, y)
    else:
        out, batch = lm_forward(model, x), (x, y)
        check_causal(lambda inputs: lm_forward(model, inputs), x)
    assert out.shape == (B, T, 2) and out.dtype == jnp.float32

    ids = tokens((B, T))
    with pytest.raises(ValueError, match=r"continuous inputs \[batch, length, 3\]"):
        model(ids, ids) if isinstance(model, EncoderDecoder) else model(ids)

    optimizer = adam(model)
    step = MSE_STEPS[cfg.kind]
    losses = [float(step(model, optimizer, *batch)) for _ in range(15)]
    assert losses[-1] < 0.5 * losses[0], losses


def test_encoder_decoder_with_continuous_source_and_token_targets():
    """Speech-to-text shape: features in, a (tied) token vocabulary out."""
    model = make(tiny("transformer-tiny", input_dim=3))
    x, _ = series(B, T)
    out = ed_forward(model, x, tokens((B, 5)))
    assert out.shape == (B, 5, VOCAB)
    with pytest.raises(ValueError, match="token ids"):
        ed_forward(model, x, x)


# ------------------------------------------------------------------ classification


@pytest.mark.parametrize("pooling", ["first", "mean"])
def test_encoder_classification(pooling):
    model = make(tiny("bert-tiny", num_classes=3, pooling=pooling))
    toks, lengths = np.asarray(tokens((B, T))), [T, 5]
    mask = lengths_mask(lengths, T)
    base, hidden = enc_classify_and_encode(model, jnp.asarray(toks), mask)
    assert base.shape == (B, 3)

    other = toks.copy()
    other[1, 5:] = (other[1, 5:] + 11) % VOCAB
    assert_close(enc_classify_and_encode(model, jnp.asarray(other), mask)[0], base)
    longer = np.concatenate([toks, np.zeros((B, 3), np.int32)], axis=1)
    out, _ = enc_classify_and_encode(model, jnp.asarray(longer), lengths_mask(lengths, T + 3))
    assert_close(out, base)

    hidden = np.asarray(hidden, np.float64)
    if pooling == "first":
        pooled = hidden[:, 0]
    else:
        pooled = np.stack([hidden[row, :n].mean(0) for row, n in enumerate(lengths)])

    def dense(layer, h):
        return h @ np.asarray(layer.kernel[...]) + np.asarray(layer.bias[...])

    expected = dense(model.classifier, np.tanh(dense(model.pooler, pooled)))  # BERT's pooler
    assert_close(base, expected, atol=1e-5)


def test_classification_needs_num_classes():
    model = make(tiny("bert-tiny"))
    with pytest.raises(ValueError, match="num_classes"):
        model.classify(tokens((B, 4)))
    with pytest.raises(ValueError, match="num_classes"):
        tiny("gpt2-tiny", num_classes=3)
