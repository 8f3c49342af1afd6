"""flaxformer_lite.nn.LayerStack: a loop and a scan of the same layers compute the same
function, scanned parameters carry the ``layers`` axis, and remat changes no value.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from nn_numpy import B, D, H, T, build, f32, f64, gelu_exact, layer_norm_ref, normal, padding_mask

from flaxformer_lite.models import ModelConfig, TransformerLayer
from flaxformer_lite.nn import MLP, Dense, LayerNorm, LayerStack, stack_layer_states

pytestmark = pytest.mark.fast_compile  # XLA's backend optimizations off: conftest.py


# --------------------------------------------------------------------------------------------
# LayerStack


class _ResidualMLP(nnx.Module):
    def __init__(self, rngs):
        self.norm = LayerNorm(16, rngs=rngs)
        self.mlp = MLP(16, 24, activation="gelu", rngs=rngs)

    def __call__(self, x):
        return x + self.mlp(self.norm(x))


def _residual_stack(**kwargs):
    return LayerStack(2, _ResidualMLP, **kwargs, rngs=nnx.Rngs(0))


def _residual_mlp_ref(state, x):
    """NumPy forward of a scanned stack of _ResidualMLP from its stacked parameters."""
    p = jax.tree.map(f64, nnx.to_pure_dict(state))
    for i in range(p["norm"]["scale"].shape[0]):
        h = layer_norm_ref(x, p["norm"]["scale"][i], p["norm"]["bias"][i], 1e-5)
        h = gelu_exact(h @ p["mlp"]["wi"]["kernel"][i] + p["mlp"]["wi"]["bias"][i])
        x = x + h @ p["mlp"]["wo"]["kernel"][i] + p["mlp"]["wo"]["bias"][i]
    return x


def _tiny_encoder_layer(rngs):
    cfg = ModelConfig.from_preset(
        "bert-tiny",
        d_model=D,
        num_heads=H,
        d_ff=64,
        embedding_dropout=0.0,
        residual_dropout=0.0,
        attention_dropout=0.0,
    )
    return TransformerLayer(cfg, num_layers=2, causal=False, cross_attention=False, rngs=rngs)


@nnx.jit
def _run_stacks(stacks, x, mask):
    """Both stacks in one program: one compile instead of two."""
    return [stack(x, mask=mask) for stack in stacks]


def test_scan_and_loop_stacks_compute_the_same_function():
    loop = build(lambda: LayerStack(2, _tiny_encoder_layer, scan=False, rngs=nnx.Rngs(0)), 1)
    scan = build(lambda: LayerStack(2, _tiny_encoder_layer, scan=True, rngs=nnx.Rngs(0)), 2)
    x = f32(normal(2, (B, T, D)))
    mask = jnp.asarray(padding_mask([T, T - 4], T))
    y_loop, y_scan_before = map(np.asarray, _run_stacks([loop, scan], x, mask))
    assert not np.allclose(y_scan_before, y_loop)  # different seeds: the update matters

    stacked = stack_layer_states([nnx.state(layer) for layer in loop.layers])
    nnx.update(scan.layers, stacked)
    kernel = stacked["mlp"]["wi"]["kernel"]
    assert kernel.get_metadata()["out_sharding"] == ("layers", "embed", "mlp")
    y_loop_again, y_scan = _run_stacks([loop, scan], x, mask)
    np.testing.assert_array_equal(y_loop_again, y_loop)
    np.testing.assert_allclose(y_scan, y_loop, rtol=1e-5, atol=1e-5)

    # The mask reaches the layers: changing the padded tokens of row 1 leaves its real tokens
    # (and row 0) unchanged, in both stacks.
    x_padding_changed = np.array(x)
    x_padding_changed[1, T - 4 :] = normal(3, (4, D))
    for y in _run_stacks([loop, scan], f32(x_padding_changed), mask):
        y = np.asarray(y)
        np.testing.assert_allclose(y[:, : T - 4], y_loop[:, : T - 4], rtol=1e-5, atol=1e-5)
        assert not np.allclose(y[1, T - 4 :], y_loop[1, T - 4 :])


def test_scanned_params_have_leading_layers_axis_name():
    loop = nnx.eval_shape(lambda: _residual_stack(scan=False))
    scan = nnx.eval_shape(lambda: _residual_stack(scan=True))
    loop_params = nnx.to_flat_state(nnx.state(loop.layers[0], nnx.Param))
    scan_params = nnx.to_flat_state(nnx.state(scan.layers, nnx.Param))
    assert [path for path, _ in loop_params] == [path for path, _ in scan_params]
    for (path, one), (_, stacked) in zip(loop_params, scan_params, strict=True):
        names = stacked.get_metadata()["out_sharding"]
        assert names == ("layers", *one.get_metadata()["out_sharding"]), path
        assert stacked.shape == (2, *one.shape), path
    specs = nnx.get_partition_spec(nnx.state(scan, nnx.Param))
    assert tuple(specs["layers"]["mlp"]["wi"]["kernel"].get_value()) == ("layers", "embed", "mlp")


def test_scanned_layers_are_initialized_independently():
    stack = LayerStack(
        3, lambda rngs: Dense(2, 3, names=("a", "b"), rngs=rngs), scan=True, rngs=nnx.Rngs(0)
    )
    kernel = np.asarray(stack.layers.kernel[...])
    assert kernel.shape == (3, 2, 3)
    assert not np.allclose(kernel[0], kernel[1]) and not np.allclose(kernel[1], kernel[2])


@nnx.jit
def _losses_and_grads(stacks, x):
    """``value_and_grad`` of every stack in one program: one compile instead of one each."""

    def loss(stack):
        return jnp.sum(jnp.sin(stack(x)))

    return [nnx.value_and_grad(loss)(stack) for stack in stacks]


def test_remat_policies_give_identical_values_and_gradients():
    x_np = normal(2, (B, 5, 16))
    policies = ("none", "full", "dots_saveable")
    stacks = [build(lambda r=r: _residual_stack(scan=True, remat=r), 1) for r in policies]
    params = nnx.state(stacks[0], nnx.Param)
    for stack in stacks[1:]:
        nnx.update(stack, params)
    (value, grads), *others = _losses_and_grads(stacks, f32(x_np))
    terms = np.sin(_residual_mlp_ref(params["layers"], x_np))
    # The loss sums 160 terms that partly cancel: its float32 round-off, in whatever order a
    # program sums, scales with the terms' magnitudes, not with the loss.
    loss_tol = dict(rtol=0, atol=1e-6 * np.abs(terms).sum())
    np.testing.assert_allclose(value, terms.sum(), **loss_tol)

    def close(a, b):  # gradients: round-off relative to each array's largest entry
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * np.abs(b).max())

    for remat, (other_value, other_grads) in zip(policies[1:], others, strict=True):
        assert stacks[policies.index(remat)].remat == remat
        np.testing.assert_allclose(other_value, value, **loss_tol)
        jax.tree.map(close, other_grads, grads)
    assert all(np.abs(np.asarray(g.get_value())).max() > 0 for _, g in nnx.to_flat_state(grads))


def test_unknown_remat_raises():
    with pytest.raises(ValueError, match="remat must be one of"):
        nnx.eval_shape(lambda: _residual_stack(remat="everything"))
