"""flaxformer_lite.models, the architecture variants: norm placement and parallel blocks,
activations, scan vs loop layers, rematerialization, bf16 compute, dropout, continuous inputs and
regression heads, and classification, on tiny models (``tiny_models.py``).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from tiny_models import (
    MSE_STEPS,
    NO_DROPOUT,
    SMALL,
    VOCAB,
    B,
    T,
    adam,
    assert_close,
    check_causal,
    ed_forward,
    enc_classify_and_encode,
    enc_forward,
    jit_nodes,
    lengths_mask,
    lm_forward,
    lm_logits_loss_and_grads,
    lm_train_step,
    make,
    max_diff,
    tiny,
    tokens,
)

from flaxformer_lite.models import Encoder, EncoderDecoder, ModelConfig, TransformerLayer
from flaxformer_lite.nn.mlp import MLP
from flaxformer_lite.nn.stack import stack_layer_states

pytestmark = pytest.mark.fast_compile  # XLA's backend optimizations off: conftest.py


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
    losses = [float(lm_train_step(model, optimizer, toks)) for _ in range(6)]
    # Six Adam steps on one batch take every variant from 4.2 to at most 0.64 of it (measured).
    assert np.all(np.diff(losses) < 0) and losses[-1] < 0.75 * losses[0], losses


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
    # Remat recomputes the forward pass inside the backward one: another program, which may sum
    # in another order, so the values agree to float32 round-off (assert_close's default).
    for remat in ("full", "dots_saveable"):
        other_logits, other_loss, other_grads = results[remat]
        assert_close(other_logits, logits)
        assert_close(other_loss, loss)
        assert jax.tree.structure(other_grads) == jax.tree.structure(grads)
        jax.tree.map(assert_close, other_grads, grads)


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
