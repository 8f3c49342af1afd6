"""The Pallas flash attention kernels (ops.pallas_attention) against the reference.

The TPU kernel runs on the CPU in Pallas' TPU interpret mode, the GPU kernel with
``interpret=True``: the kernels' own code, block by block, slowly, so shapes stay tiny (the
kernels' blocks are 128 positions: every length here is padded to one block). A v5e
compile-only topology (libtpu, the ``tpu`` extra) checks that the TPU program compiles under a
sharded mesh.
"""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_cases import ATOL, assert_close_to_scale, make_qkv
from flax import nnx
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import NamedSharding, PartitionSpec
from tpu_topology import v5e_2x2

from flaxformer_lite import ops, parallel
from flaxformer_lite.aot.topology import H100_TARGET_CONFIG
from flaxformer_lite.data.tasks import TASKS
from flaxformer_lite.ops import attention_choice, pallas_attention
from flaxformer_lite.train.config import load_config
from flaxformer_lite.train.optim import make_optimizer
from flaxformer_lite.train.program import make_train_state
from flaxformer_lite.train.step import make_train_step

pytestmark = pytest.mark.fast_compile  # XLA's backend optimizations off: conftest.py

T = 9  # not a multiple of the kernels' block: padded keys must stay hidden

# Rows: real lengths 5 (right padding) and 6 keys from the left (left padding: with a causal mask
# the first queries see no key and must be zeros).
KEY_VALID = np.stack([np.arange(T) < 5, np.arange(T) >= 3])
SEGMENTS = np.array([[0, 0, 0, 1, 1, 1, 1, 2, 2], [3, 3, 3, 3, 3, 5, 5, 5, 5]])


def reference(q, k, v, *, key_valid=None, segment_ids=None, is_causal=False):
    mask = None if key_valid is None else jnp.asarray(key_valid)[:, None, None, :]
    if segment_ids is not None:
        mask = ops.combine_masks(mask, ops.segment_mask(*segment_ids))
    return ops.reference_attention(q, k, v, None, mask, is_causal=is_causal)


def tpu_pallas(q, k, v, *, key_valid=None, segment_ids=None, is_causal=False):
    mask = None if key_valid is None else jnp.asarray(key_valid)[:, None, None, :]
    return ops.dot_product_attention(
        q, k, v, None, mask, is_causal=is_causal, segment_ids=segment_ids, implementation="pallas"
    )


TPU_CASES = {
    "causal_gqa": dict(is_causal=True),
    "padding_causal": dict(is_causal=True, key_valid=KEY_VALID),
    "segments_and_padding": dict(segment_ids=(SEGMENTS, SEGMENTS), key_valid=KEY_VALID),
    "cross_attention_segments": dict(segment_ids=(SEGMENTS[:, :4], SEGMENTS), tq=4),
}


@pytest.mark.parametrize("case", TPU_CASES)
def test_tpu_kernel_equals_reference_in_interpret_mode(case):
    kwargs = dict(TPU_CASES[case])
    q, k, v = make_qkv(0, tq=kwargs.pop("tq", T), tk=T, hq=4, hk=2, d=8)
    with pltpu.force_tpu_interpret_mode():
        out = tpu_pallas(q, k, v, **kwargs)
        jaxpr = str(jax.make_jaxpr(lambda *a: tpu_pallas(*a, **kwargs))(q, k, v))
    assert "pallas_call" in jaxpr
    np.testing.assert_allclose(out, reference(q, k, v, **kwargs), atol=ATOL, rtol=0)


@pytest.mark.slow
def test_tpu_kernel_gradients_equal_reference_in_interpret_mode():
    q, k, v = make_qkv(1, tq=T, tk=T, hq=4, hk=2, d=8)
    weights = jnp.asarray(np.random.default_rng(2).standard_normal(q.shape), jnp.float32)
    masks = dict(is_causal=True, key_valid=KEY_VALID)

    def loss(fn):
        return lambda *qkv: jnp.sum(fn(*qkv, **masks) * weights)

    with pltpu.force_tpu_interpret_mode():
        grads = jax.grad(loss(tpu_pallas), argnums=(0, 1, 2))(q, k, v)
    expected = jax.grad(loss(reference), argnums=(0, 1, 2))(q, k, v)
    for got, want in zip(grads, expected, strict=True):
        assert_close_to_scale(got, want)


def test_gpu_kernel_equals_reference_in_interpret_mode():
    q, k, v = make_qkv(3, b=1, tq=T, tk=T, hq=2, hk=1, d=8)
    scale = 8**-0.5

    def kernel(*qkv):
        return pallas_attention.gpu_flash_attention(
            *qkv, scale=scale, is_causal=True, interpret=True
        )

    out = kernel(q, k, v)
    np.testing.assert_allclose(out, reference(q, k, v, is_causal=True), atol=ATOL, rtol=0)
    grads = jax.grad(lambda *qkv: jnp.sum(kernel(*qkv) * out), argnums=(0, 1, 2))(q, k, v)
    expected = jax.grad(
        lambda *qkv: jnp.sum(reference(*qkv, is_causal=True) * out), argnums=(0, 1, 2)
    )(q, k, v)
    for got, want in zip(grads, expected, strict=True):
        assert_close_to_scale(got, want)


UNSUPPORTED = {
    "an additive bias": dict(bias=True),
    "local windows": dict(local_window=(2, 0)),
    "attention dropout": dict(dropout_rate=0.1),
    "a causal mask needs T == S": dict(is_causal=True, tq=4),
    "only key padding masks": dict(mask=True),
}


@pytest.mark.parametrize("reason", UNSUPPORTED)
def test_unsupported_inputs_fall_back_with_the_reason_logged(reason, caplog):
    kwargs = dict(UNSUPPORTED[reason])
    q, k, v = make_qkv(4, tq=kwargs.pop("tq", T), tk=T)
    bias = jnp.ones((1, 1, 1, T)) if kwargs.pop("bias", False) else None
    mask = jnp.asarray(np.random.default_rng(5).random((2, 1, q.shape[1], T)) < 0.7)
    mask = mask if kwargs.pop("mask", False) else None
    rng = jax.random.key(0) if kwargs.get("dropout_rate") else None
    logs = caplog.at_level(logging.INFO, "flaxformer_lite.ops.attention")
    with logs, pltpu.force_tpu_interpret_mode():
        run = lambda: ops.dot_product_attention(  # noqa: E731
            q, k, v, bias, mask, **kwargs, dropout_rng=rng, implementation="pallas"
        )
        jaxpr = str(jax.make_jaxpr(run)())
        out = run()
    assert "pallas_call" not in jaxpr
    assert any(reason in record.getMessage() for record in caplog.records)
    if rng is None:
        expected = ops.reference_attention(q, k, v, bias, mask, **kwargs)
        np.testing.assert_allclose(out, expected, atol=ATOL, rtol=0)


def test_automatic_choice_is_pallas_on_tpu_only():
    q, k, v = make_qkv(6)

    def uses_kernel():
        run = lambda: ops.dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
        return "pallas_call" in str(jax.make_jaxpr(run)())

    assert not uses_kernel()  # the CPU
    with pltpu.force_tpu_interpret_mode():
        assert uses_kernel()


def test_mesh_axes_split_batch_and_heads_where_they_divide():
    mesh = jax.sharding.AbstractMesh((2, 2, 2), ("data", "fsdp", "tensor"))
    assert pallas_attention.kernel_mesh_axes(mesh, 8, 4) == (("data", "fsdp"), ("tensor",))
    assert pallas_attention.kernel_mesh_axes(mesh, 2, 3) == (("data",), ())


@pytest.mark.parametrize("length", [T, 128])  # padded with kernel ids; a whole block, none
def test_tpu_kernel_under_a_mesh_runs_in_shard_map_and_equals_reference(length):
    mesh = parallel.make_mesh(data=2, fsdp=1, tensor=2, devices=jax.devices()[:4])
    q, k, v = make_qkv(7, tq=length, tk=length, hq=2, hk=1, d=8)
    key_valid = np.arange(length)[None] >= np.array([[0], [3]])  # row 1: left padding

    @jax.jit
    def attend(q, k, v):
        return tpu_pallas(q, k, v, key_valid=key_valid, is_causal=True)

    with jax.set_mesh(mesh), pltpu.force_tpu_interpret_mode():
        assert "shard_map" in str(jax.make_jaxpr(attend)(q, k, v))
        out = attend(q, k, v)
    expected = reference(q, k, v, key_valid=key_valid, is_causal=True)
    np.testing.assert_allclose(out, expected, atol=ATOL, rtol=0)


def test_tpu_kernel_compiles_for_v5e_under_a_sharded_mesh():
    from jax.experimental import topologies

    topology = v5e_2x2()
    mesh = topologies.make_mesh(topology, (2, 1, 2), ("data", "fsdp", "tensor"))
    b, t, h, hk, dh = 4, 200, 4, 2, 64
    heads = PartitionSpec("data", None, "tensor", None)

    def abstract(shape, dtype, spec):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))

    args = (
        abstract((b, t, h, dh), jnp.bfloat16, heads),
        abstract((b, t, hk, dh), jnp.bfloat16, heads),
        abstract((b, t, hk, dh), jnp.bfloat16, heads),
        abstract((b, t), jnp.bool_, PartitionSpec("data")),
    )

    def loss(q, k, v, valid):
        out = ops.dot_product_attention(q, k, v, None, valid[:, None, None, :], is_causal=True)
        return jnp.sum(out.astype(jnp.float32))

    # conftest.py asks for float32 precision, which Mosaic rejects for bf16 matmuls.
    with jax.set_mesh(mesh), jax.default_matmul_precision("default"):
        compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*args).compile()
    # The forward kernel and the two of the backward pass (dK/dV and dQ).
    assert compiled.as_text().count("tpu_custom_call") == 3


def test_packed_gpt2_train_step_compiled_for_v5e_runs_the_pallas_kernel(caplog):
    # Packed rows reach the attention as segment ids, which the kernel takes, not as a
    # [B, 1, T, T] mask, which it cannot.
    from jax.experimental import topologies

    topology = v5e_2x2()
    overrides = ["model.dtype=bfloat16", "model.attention_dropout=0.0", "mesh.data=4"]
    cfg = load_config(None, overrides)
    mesh = topologies.make_mesh(topology, (4, 1, 1, 1), parallel.MESH_AXES)
    tx, _ = make_optimizer(cfg.optimizer, cfg.model, total_steps=cfg.train.steps)
    graphdef, state, shardings = parallel.abstract_sharded(
        lambda: make_train_state(cfg, tx), mesh, cfg.mesh.rules
    )
    attention_choice.log_once.cache_clear()  # a fallback logged by an earlier test counts too
    rules = nnx.logical_axis_rules(parallel.rule_pairs(cfg.mesh.rules))
    # conftest.py asks for float32 precision, which Mosaic rejects for bf16 matmuls.
    precision = jax.default_matmul_precision("default")
    caplog.set_level(logging.INFO, logger="flaxformer_lite.ops.attention")
    with jax.set_mesh(mesh), rules, precision:
        rows = parallel.batch_sharding(mesh, cfg.mesh.rules)
        ints = jax.ShapeDtypeStruct((8, cfg.data.seq_len), jnp.int32, sharding=rows)
        weights = jax.ShapeDtypeStruct(ints.shape, jnp.float32, sharding=rows)
        batch = dict(inputs=ints, targets=ints, weights=weights, positions=ints, segment_ids=ints)
        step = make_train_step(graphdef, task=TASKS["lm"], state_shardings=shardings)
        hlo = step.lower(state, batch).compile().as_text()
    assert "tpu_custom_call" in hlo
    assert not [r.message for r in caplog.records if "attention:" in r.message]


def test_cudnn_attention_compiles_for_an_h100_without_a_gpu():
    pytest.importorskip("jax_plugins.xla_cuda12")  # jax-cuda12-plugin and -pjrt
    pytest.importorskip("nvidia.cudnn")  # nvidia-cudnn-cu12: cuDNN builds its graph at compile
    from jax.experimental import topologies

    try:
        topology = topologies.get_topology_desc(
            platform="cuda", target_config=H100_TARGET_CONFIG, topology="1x1x8"
        )
    except NotImplementedError as error:  # the plugin failed to start for want of a GPU
        pytest.skip(f"{error}: on a machine without a GPU, run with JAX_PLATFORMS=cpu")
    mesh = topologies.make_mesh(topology, (8,), ("data",))
    x = jax.ShapeDtypeStruct(
        (8, 128, 4, 64), jnp.bfloat16, sharding=NamedSharding(mesh, PartitionSpec("data"))
    )

    def attention(q):
        return jax.nn.dot_product_attention(q, q, q, is_causal=True, implementation="cudnn")

    with jax.default_matmul_precision("default"):
        compiled = jax.jit(attention).lower(x).compile()
    assert "__cudnn$fmha" in compiled.as_text()
