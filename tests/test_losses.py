"""Tests for flaxformer_lite.ops.losses against optax and float64 NumPy formulas."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from flaxformer_lite.ops.losses import chunked_cross_entropy, cross_entropy

pytestmark = pytest.mark.fast_compile  # XLA's backend optimizations off: conftest.py

B, T, V = 2, 6, 11
# float32 against float64 or another float32 program: sums over V classes and B * T tokens in
# any order (AVX2 and AVX-512 differ) are ~(V + B * T) * 2**-24 ≈ 1.4e-6 relative apart at most.
RTOL = 1e-5


def _f64(a):
    return np.asarray(jnp.asarray(a).astype(jnp.float32), np.float64)


def _lse(logits):
    m = logits.max(-1, keepdims=True)
    return (m + np.log(np.exp(logits - m).sum(-1, keepdims=True)))[..., 0]


def _smoothed_ce_ref(logits, targets, alpha):
    """Per-token float64 cross-entropy against (1 - alpha) * onehot + alpha / V."""
    logits = _f64(logits)
    log_probs = logits - _lse(logits)[..., None]
    labels = (1 - alpha) * np.eye(logits.shape[-1])[np.asarray(targets)] + alpha / logits.shape[-1]
    return -(labels * log_probs).sum(-1)


@pytest.fixture
def data():
    # NumPy-drawn inputs of one fixed shape: every new shape or dtype makes eager JAX compile each
    # primitive again, which dominates this file's run time on a small CPU.
    gen = np.random.default_rng(0)
    logits = jnp.asarray(3.0 * gen.standard_normal((B, T, V)), jnp.float32)
    targets = jnp.asarray(gen.integers(0, V, (B, T)), jnp.int32)
    weights = gen.uniform(size=(B, T)) < 0.7
    weights[:, 0] = True
    return logits, targets, jnp.asarray(weights)


def test_matches_optax_integer_labels(data):
    logits, targets, _ = data
    loss, metrics = cross_entropy(logits, targets)
    expected = optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
    np.testing.assert_allclose(loss, expected, rtol=RTOL)
    np.testing.assert_allclose(metrics["loss"], expected, rtol=RTOL)
    assert metrics["num_tokens"] == B * T


@pytest.mark.parametrize("alpha", [0.1, 0.5])
def test_label_smoothing(data, alpha):
    logits, targets, _ = data
    loss, _ = cross_entropy(logits, targets, label_smoothing=alpha)
    np.testing.assert_allclose(loss, _smoothed_ce_ref(logits, targets, alpha).mean(), rtol=RTOL)
    smoothed = optax.smooth_labels(jax.nn.one_hot(targets, V), alpha)
    np.testing.assert_allclose(
        loss, optax.softmax_cross_entropy(logits, smoothed).mean(), rtol=RTOL
    )
    assert not np.isclose(loss, cross_entropy(logits, targets)[0])


def test_weights_exclude_padding(data):
    logits, targets, weights = data
    loss, metrics = cross_entropy(
        logits, targets, weights=weights, label_smoothing=0.1, z_loss=1e-3
    )
    real = np.asarray(weights)
    per_token = _smoothed_ce_ref(logits, targets, 0.1)[real]
    z = 1e-3 * _lse(_f64(logits))[real] ** 2
    np.testing.assert_allclose(metrics["loss"], per_token.mean(), rtol=RTOL)
    np.testing.assert_allclose(loss, (per_token + z).mean(), rtol=RTOL)
    assert metrics["num_tokens"] == real.sum()

    # Anything at weight-0 positions, including an out-of-range padding id, changes nothing.
    pad = ~weights
    garbage_logits = jnp.where(pad[..., None], 50.0 * np.cos(np.asarray(logits)), logits)
    garbage_targets = jnp.where(pad, -100, targets)
    loss2, metrics2 = cross_entropy(
        garbage_logits, garbage_targets, weights=weights, label_smoothing=0.1, z_loss=1e-3
    )
    np.testing.assert_array_equal(loss2, loss)
    for key in metrics:
        np.testing.assert_array_equal(metrics2[key], metrics[key])
    grad = jax.grad(lambda lg: cross_entropy(lg, garbage_targets, weights=weights)[0])(logits)
    assert np.all(np.isfinite(grad))
    np.testing.assert_array_equal(np.asarray(grad)[np.asarray(pad)], 0.0)


def test_fractional_weights(data):
    logits, targets, _ = data
    w = jnp.asarray(np.linspace(0.0, 2.0, B * T).reshape(B, T), jnp.float32)
    loss, metrics = cross_entropy(logits, targets, weights=w)
    per_token = _smoothed_ce_ref(logits, targets, 0.0)
    np.testing.assert_allclose(loss, (per_token * _f64(w)).sum() / _f64(w).sum(), rtol=RTOL)
    np.testing.assert_allclose(metrics["num_tokens"], _f64(w).sum(), rtol=RTOL)


def test_all_zero_weights_give_zero(data):
    logits, targets, _ = data
    zeros = jnp.zeros((B, T))
    loss, metrics = cross_entropy(logits, targets, weights=zeros, label_smoothing=0.1, z_loss=1e-2)
    assert loss == 0.0
    assert all(v == 0.0 for v in metrics.values())
    grad = jax.grad(lambda lg: cross_entropy(lg, targets, weights=zeros)[0])(logits)
    np.testing.assert_array_equal(grad, 0.0)


def test_z_loss_adds_mean_squared_lse(data):
    logits, targets, _ = data
    z = 1e-2
    loss0, metrics0 = cross_entropy(logits, targets, label_smoothing=0.1)
    loss, metrics = cross_entropy(logits, targets, label_smoothing=0.1, z_loss=z)
    expected_z = z * np.mean(_lse(_f64(logits)) ** 2)
    assert expected_z > 1e-2  # large enough for the check below to mean something
    np.testing.assert_allclose(loss - loss0, expected_z, rtol=RTOL)
    np.testing.assert_allclose(metrics["z_loss"], expected_z, rtol=RTOL)
    np.testing.assert_allclose(metrics["loss"], metrics0["loss"], rtol=1e-7)  # the same operations
    assert metrics0["z_loss"] == 0.0


def test_accuracy_and_num_tokens(data):
    logits, targets, weights = data
    predicted = np.asarray(targets).copy()
    predicted[0, :3] = (predicted[0, :3] + 1) % V  # three wrong predictions, the rest right
    # A margin of 10 makes the argmax the predicted class whatever the random logits are.
    logits = logits + 10.0 * jax.nn.one_hot(predicted, V) * jnp.max(jnp.abs(logits))
    _, metrics = cross_entropy(logits, targets)
    np.testing.assert_allclose(metrics["accuracy"], 1 - 3 / (B * T), rtol=1e-6)
    assert metrics["num_tokens"] == B * T
    w = np.asarray(weights)
    _, metrics = cross_entropy(logits, targets, weights=weights)
    expected = (w * (predicted == np.asarray(targets))).sum() / w.sum()
    np.testing.assert_allclose(metrics["accuracy"], expected, rtol=1e-6)
    assert metrics["num_tokens"] == w.sum()
    assert all(v.dtype == jnp.float32 and v.shape == () for v in metrics.values())


def test_accuracy_counts_the_first_maximum_as_argmax_does():
    # Ties: a constant row (argmax 0), the maximum twice with the target second or first, a
    # negative target where the last class holds the maximum (take_along_axis wraps -1 to it),
    # and an out-of-range padding target under weight 0.
    logits = np.zeros((7, V), np.float32)
    logits[1, [2, 5]] = logits[2, [2, 5]] = logits[3, [4]] = logits[5, [V - 1]] = 1.0
    logits[4] = np.arange(V)
    targets = np.array([0, 5, 2, 4, 0, -1, -100], np.int32)
    weights = np.array([1, 1, 1, 1, 1, 1, 0], np.float32)
    _, metrics = cross_entropy(
        jnp.asarray(logits), jnp.asarray(targets), weights=jnp.asarray(weights)
    )
    expected = np.mean(np.argmax(logits[:6], -1) == targets[:6])  # 0, 2 and 4 are right
    assert expected == 3 / 6
    np.testing.assert_allclose(metrics["accuracy"], expected, rtol=1e-6)


def test_accuracy_with_narrow_target_ids_and_a_wide_vocabulary():
    # uint8 ids against 300 classes: positions above 255 must not wrap around to small ids.
    logits = np.zeros((2, 300), np.float32)
    logits[:, [10, 260]] = 1.0
    targets = np.array([10, 200], np.uint8)
    _, metrics = cross_entropy(jnp.asarray(logits), jnp.asarray(targets))
    np.testing.assert_allclose(metrics["accuracy"], 0.5, rtol=1e-6)


def test_large_logits_are_finite(data):
    logits, targets, _ = data
    big = jnp.asarray(1e4 * np.tanh(np.asarray(logits)), jnp.float32)
    loss, metrics = cross_entropy(big, targets, label_smoothing=0.1, z_loss=1e-4)
    assert all(np.isfinite(v) for v in [loss, *metrics.values()])
    np.testing.assert_allclose(
        metrics["loss"], _smoothed_ce_ref(big, targets, 0.1).mean(), rtol=1e-5
    )
    assert np.all(np.isfinite(jax.grad(lambda lg: cross_entropy(lg, targets)[0])(big)))


def test_bf16_logits(data):
    logits, targets, weights = data
    low = logits.astype(jnp.bfloat16)
    loss, metrics = cross_entropy(low, targets, weights=weights, label_smoothing=0.1)
    assert loss.dtype == jnp.float32
    # Computed in float32: identical to upcasting first, and close to the unrounded logits.
    loss_up, _ = cross_entropy(
        low.astype(jnp.float32), targets, weights=weights, label_smoothing=0.1
    )
    np.testing.assert_allclose(loss, loss_up, rtol=1e-6)
    loss32, _ = cross_entropy(logits, targets, weights=weights, label_smoothing=0.1)
    np.testing.assert_allclose(loss, loss32, rtol=1e-2)
    assert jax.grad(lambda lg: cross_entropy(lg, targets)[0])(low).dtype == jnp.bfloat16


@pytest.mark.parametrize("alpha", [0.0, 0.2])
def test_grad_is_softmax_minus_smoothed_target(data, alpha):
    logits, targets, weights = data
    grad = jax.grad(
        lambda lg: cross_entropy(lg, targets, weights=weights, label_smoothing=alpha)[0]
    )(logits)
    logits64 = _f64(logits)
    softmax = np.exp(logits64 - _lse(logits64)[..., None])
    smoothed = (1 - alpha) * np.eye(V)[np.asarray(targets)] + alpha / V
    w = _f64(weights)[..., None]
    expected = w * (softmax - smoothed) / w.sum()
    np.testing.assert_allclose(grad, expected, atol=RTOL * np.abs(expected).max())


def test_jit_vmap_grad_match_eager(data):
    logits, targets, weights = data

    def f(lg, t, w):
        return cross_entropy(lg, t, weights=w, label_smoothing=0.1, z_loss=1e-3)

    eager_loss, eager_metrics = f(logits, targets, weights)
    jit_loss, jit_metrics = jax.jit(f)(logits, targets, weights)
    np.testing.assert_allclose(jit_loss, eager_loss, rtol=RTOL)
    for key in eager_metrics:
        np.testing.assert_allclose(jit_metrics[key], eager_metrics[key], rtol=RTOL)

    # vmap over the batch gives one loss per sequence, each averaged over its own real tokens.
    per_sequence, _ = jax.jit(jax.vmap(f))(logits, targets, weights)
    w = np.asarray(weights)
    per_token = _smoothed_ce_ref(logits, targets, 0.1) + 1e-3 * _lse(_f64(logits)) ** 2
    np.testing.assert_allclose(per_sequence, (per_token * w).sum(1) / w.sum(1), rtol=RTOL)

    grad_eager = jax.grad(lambda lg: f(lg, targets, weights)[0])(logits)
    grad_jit = jax.jit(jax.grad(lambda lg: f(lg, targets, weights)[0]))(logits)
    np.testing.assert_allclose(grad_jit, grad_eager, atol=RTOL * np.abs(grad_eager).max())


@pytest.mark.parametrize(
    ("logits_shape", "targets_shape", "weights_shape", "match"),
    [
        ((B, T, V), (B, T, 1), None, r"\(2, 6, 11\).*\(2, 6, 1\)"),
        ((B, T, V), (B, T + 1), None, r"\(2, 6, 11\).*\(2, 7\)"),
        ((B, T), (B, T), None, r"\(2, 6\).*\(2, 6\)"),
        # (T,) would broadcast against (B, T) silently, so only the explicit check catches it.
        ((B, T, V), (B, T), (T,), r"weights.*\(2, 6\).*\(6,\)"),
    ],
)
def test_shape_errors(logits_shape, targets_shape, weights_shape, match):
    weights = None if weights_shape is None else jnp.ones(weights_shape)
    with pytest.raises(ValueError, match=match):
        cross_entropy(jnp.zeros(logits_shape), jnp.zeros(targets_shape, jnp.int32), weights=weights)


@pytest.mark.parametrize("alpha", [-0.1, 1.0])
def test_label_smoothing_range(data, alpha):
    logits, targets, _ = data
    with pytest.raises(ValueError, match=str(alpha)):
        cross_entropy(logits, targets, label_smoothing=alpha)


def test_float_targets_rejected(data):
    logits, targets, _ = data
    with pytest.raises(TypeError, match="float32"):
        cross_entropy(logits, targets.astype(jnp.float32))


# The chunked loss: hidden features [B, T, D] and an output projection (with a bias, so that the
# projection's own gradients are checked too) instead of logits.
D = 5


@pytest.fixture
def projected(data):
    _, targets, weights = data
    gen = np.random.default_rng(1)
    hidden = jnp.asarray(gen.standard_normal((B, T, D)), jnp.float32)
    params = {
        "kernel": jnp.asarray(gen.standard_normal((D, V)), jnp.float32),
        "bias": jnp.asarray(gen.standard_normal(V), jnp.float32),
    }
    return hidden, params, targets, weights


def _project(params, h):
    return h @ params["kernel"] + params["bias"]


@pytest.mark.parametrize("chunk", [1, 4, 6, 100])  # 4 does not divide T = 6; 100 exceeds it
@pytest.mark.parametrize("alpha, z", [(0.0, 0.0), (0.1, 1e-2)])
def test_chunked_equals_plain_in_values_and_gradients(projected, chunk, alpha, z):
    hidden, params, targets, weights = projected
    # weights: padding (0), fractional and whole, as a packed or masked batch has them.
    weights = jnp.where(weights, jnp.linspace(0.25, 1.0, T), 0.0)
    kwargs = dict(weights=weights, label_smoothing=alpha, z_loss=z)

    def plain(hidden, params):
        return cross_entropy(_project(params, hidden), targets, **kwargs)

    def chunked(hidden, params):
        project = lambda h: _project(params, h)  # noqa: E731
        return chunked_cross_entropy(hidden, targets, project, chunk=chunk, **kwargs)

    (want, want_metrics), want_grads = jax.value_and_grad(plain, (0, 1), has_aux=True)(
        hidden, params
    )
    (got, got_metrics), got_grads = jax.jit(jax.value_and_grad(chunked, (0, 1), has_aux=True))(
        hidden, params
    )
    np.testing.assert_allclose(got, want, rtol=RTOL)
    for key in want_metrics:
        np.testing.assert_allclose(got_metrics[key], want_metrics[key], rtol=RTOL, err_msg=key)
    jax.tree.map(
        lambda g, w: np.testing.assert_allclose(g, w, rtol=RTOL, atol=1e-7), got_grads, want_grads
    )
    # And the float64 formula, through the logits the projection gives.
    logits = _f64(_project(params, hidden))
    ref = _smoothed_ce_ref(logits, targets, alpha) + z * _lse(logits) ** 2
    w = np.asarray(weights, np.float64)
    np.testing.assert_allclose(got, (ref * w).sum() / w.sum(), rtol=RTOL)


def test_chunked_bf16_projection_equals_plain(projected):
    hidden, params, targets, weights = projected

    def project(h):
        return _project(params, h).astype(jnp.bfloat16)

    want = cross_entropy(project(hidden), targets, weights=weights)[1]
    got = chunked_cross_entropy(hidden, targets, project, chunk=4, weights=weights)[1]
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=RTOL, err_msg=key)


def test_chunked_keeps_one_block_of_logits_in_the_backward_pass():
    """The gradient's compiled program holds no [B, T, V] array: XLA's temporaries shrink."""
    b, t, d, v = 4, 256, 32, 4096
    hidden = jax.ShapeDtypeStruct((b, t, d), jnp.float32)
    kernel = jax.ShapeDtypeStruct((d, v), jnp.float32)
    targets = jax.ShapeDtypeStruct((b, t), jnp.int32)

    def temp_bytes(loss):
        grad = jax.jit(jax.grad(lambda h, k, y: loss(h, k, y)[0], (0, 1)))
        return grad.lower(hidden, kernel, targets).compile().memory_analysis().temp_size_in_bytes

    plain = temp_bytes(lambda h, k, y: cross_entropy(h @ k, y))
    chunked = temp_bytes(lambda h, k, y: chunked_cross_entropy(h, y, lambda x: x @ k, chunk=32))
    logits_bytes = b * t * v * 4  # 16 MiB; a block's are 2 MiB
    assert plain >= logits_bytes and 4 * chunked < plain, (plain, chunked)


@pytest.mark.parametrize(
    "hidden_shape, chunk, match",
    [((B, T), 2, r"hidden must be \[B, T, D\]"), ((B, T, D), 0, "chunk must be a positive")],
)
def test_chunked_shape_and_chunk_errors(projected, hidden_shape, chunk, match):
    _, params, targets, _ = projected
    with pytest.raises(ValueError, match=match):
        chunked_cross_entropy(
            jnp.zeros(hidden_shape), targets, lambda h: _project(params, h), chunk=chunk
        )
