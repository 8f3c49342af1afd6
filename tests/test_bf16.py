"""bfloat16 training: ``model.dtype=bfloat16`` computes in bf16 on float32 parameters (softmax,
norms and the loss in float32), learns as float32 does, and runs its TPU matmuls in bf16."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_cases import BF16_GRAD_REL, assert_close_to_scale, make_qkv
from flax import nnx
from test_train_e2e import losses, quiet
from tiny_runs import SHARED_RUNS
from tpu_topology import v5e_2x2

from flaxformer_lite import ops, parallel
from flaxformer_lite.data.tasks import TASKS
from flaxformer_lite.train.config import load_config
from flaxformer_lite.train.loop import run
from flaxformer_lite.train.optim import make_optimizer
from flaxformer_lite.train.program import make_train_state
from flaxformer_lite.train.step import make_train_step

pytestmark = pytest.mark.fast_compile  # XLA's backend optimizations off: conftest.py


def final_loss(run_dir):
    """The mean logged loss of the last 50 steps (10 logs: one batch's loss is noisy)."""
    logged = losses(run_dir)
    return np.mean([loss for step, loss in logged.items() if step > max(logged) - 50])


@pytest.mark.slow
def test_bfloat16_trains_the_default_run_within_2_percent_of_float32(tmp_path, trained_runs):
    """The embedded default shortened (SHARED_RUNS["quick"]): its float32 run is shared with
    test_train_e2e.py, the bfloat16 one differs in the dtype alone."""
    float32_run = trained_runs("quick")
    overrides = [f"run_dir={tmp_path / 'bfloat16'}", *SHARED_RUNS["quick"], "model.dtype=bfloat16"]
    run(load_config(None, overrides), progress=False, log=quiet)
    float32, bfloat16 = final_loss(float32_run), final_loss(tmp_path / "bfloat16")
    first = losses(float32_run)[5]
    assert float32 < 0.6 * first  # it learned: the comparison is not between two starts
    assert abs(bfloat16 - float32) <= 0.02 * float32, (bfloat16, float32)


def test_xla_attention_in_bf16_has_bf16_backward_matmuls_and_float32_like_gradients():
    q, k, v = make_qkv(0, tq=12, tk=12, hq=4, hk=2, d=8)
    weights = jnp.asarray(np.random.default_rng(1).standard_normal(q.shape), jnp.float32)

    def loss(q, k, v):
        out = ops.dot_product_attention(q, k, v, is_causal=True, implementation="xla")
        return jnp.sum(out.astype(jnp.float32) * weights)

    grad = jax.grad(loss, argnums=(0, 1, 2))
    low = [x.astype(jnp.bfloat16) for x in (q, k, v)]
    stablehlo = jax.jit(grad).lower(*low).as_text()
    # Every product of the forward and backward pass reads bf16 operands only.
    tensor = r"tensor<(?:\d+x)*(\w+)>"
    operands = re.findall(rf"dot_general .*: \({tensor}, {tensor}\)", stablehlo)
    assert operands and {dtype for pair in operands for dtype in pair} == {"bf16"}, operands
    for g16, g32 in zip(grad(*low), grad(q, k, v), strict=True):
        assert g16.dtype == jnp.bfloat16
        assert_close_to_scale(g16.astype(jnp.float32), g32, rel=BF16_GRAD_REL)
        with pytest.raises(AssertionError):  # a gradient 3% off everywhere fails
            assert_close_to_scale(1.03 * g16.astype(jnp.float32), g32, rel=BF16_GRAD_REL)
    # The float32 products keep forward-mode autodiff (a custom JVP, not a custom VJP).
    tangent = jax.jvp(loss, (q, k, v), (q, k, v))[1]
    assert np.isfinite(float(tangent))


# The default's attention (no dropout) runs in the Pallas kernel on TPU: a custom call, not a dot.
ATTENTION = {"xla": ["model.attention_implementation=xla"], "pallas": []}


@pytest.mark.parametrize("attention", ATTENTION)
def test_bfloat16_train_step_compiled_for_v5e_does_its_matmuls_in_bf16(attention):
    from jax.experimental import topologies

    topology = v5e_2x2()
    cfg = load_config(None, ["model.dtype=bfloat16", "mesh.data=4", *ATTENTION[attention]])
    mesh = topologies.make_mesh(topology, (4, 1, 1, 1), parallel.MESH_AXES)
    rules = cfg.mesh.rules
    tx, _ = make_optimizer(cfg.optimizer, cfg.model, total_steps=cfg.train.steps)
    graphdef, state, shardings = parallel.abstract_sharded(
        lambda: make_train_state(cfg, tx), mesh, rules
    )
    # conftest.py asks for float32 precision, which Mosaic rejects for bf16 matmuls.
    precision = jax.default_matmul_precision("default")
    with jax.set_mesh(mesh), nnx.logical_axis_rules(parallel.rule_pairs(rules)), precision:
        rows = parallel.batch_sharding(mesh, rules)
        tokens = jax.ShapeDtypeStruct((8, cfg.data.seq_len), jnp.int32, sharding=rows)
        weights = jax.ShapeDtypeStruct(tokens.shape, jnp.float32, sharding=rows)
        batch = {"inputs": tokens, "targets": tokens, "weights": weights}
        step = make_train_step(graphdef, task=TASKS["lm"], state_shardings=shardings)
        hlo = step.lower(state, batch).compile().as_text()
    assert ("tpu_custom_call" in hlo) == (attention == "pallas")
    # Parameters stay float32; every matmul of the step (forward and backward) reads bf16.
    assert {x.dtype for x in jax.tree.leaves(nnx.filter_state(state[0], nnx.Param))} == {
        jnp.dtype(jnp.float32)
    }
    # Optimized HLO names its operands; their types are where they are defined.
    types = dict(re.findall(r"(%[\w.\-]+) = (\w+)\[", hlo))
    matmuls = re.findall(r"= \S+ (?:dot|convolution)\((%[^,]+), (%[^,)]+)", hlo)
    assert matmuls, "no dot or convolution in the compiled step"
    operand_types = {types[name] for pair in matmuls for name in pair}
    assert operand_types == {"bf16"}, operand_types
