"""Optimizer and schedules: closed-form values, the weight-decay mask, clipping, validation."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from flaxformer_lite.models import ModelConfig, build_model
from flaxformer_lite.train.optim import (
    OptimizerConfig,
    fitted_warmup_steps,
    inverse_sqrt_schedule,
    make_optimizer,
    make_schedule,
    warmup_notice,
    weight_decay_mask,
)

pytestmark = pytest.mark.fast_compile  # XLA's backend optimizations off: conftest.py


def values(schedule, steps):
    return np.array([float(schedule(step)) for step in steps])


def test_warmup_then_cosine():
    cfg = OptimizerConfig(lr=2e-3, schedule="cosine", warmup_steps=10, end_lr_ratio=0.1)
    schedule = make_schedule(cfg, total_steps=110, d_model=64)
    steps = [0, 5, 10, 35, 60, 110]
    progress = np.array([0, 0, 0, 25, 50, 100]) / 100
    cosine = 2e-4 + (2e-3 - 2e-4) * 0.5 * (1 + np.cos(np.pi * progress))
    expected = np.where(np.array(steps) < 10, 2e-3 * np.array(steps) / 10, cosine)
    np.testing.assert_allclose(values(schedule, steps), expected, rtol=1e-5)


def test_warmup_then_linear_and_constant():
    linear = make_schedule(
        OptimizerConfig(lr=1.0, schedule="linear", warmup_steps=4, end_lr_ratio=0.0),
        total_steps=12,
        d_model=64,
    )
    np.testing.assert_allclose(
        values(linear, [0, 2, 4, 8, 12]), [0.0, 0.5, 1.0, 0.5, 0.0], atol=1e-6
    )
    constant = make_schedule(
        OptimizerConfig(lr=0.5, schedule="constant", warmup_steps=2), total_steps=100, d_model=64
    )
    np.testing.assert_allclose(values(constant, [0, 1, 2, 50, 99]), [0, 0.25, 0.5, 0.5, 0.5])


def test_inverse_sqrt_is_the_papers_formula():
    d_model, warmup = 512, 4000
    schedule = inverse_sqrt_schedule(1.0, warmup_steps=warmup, d_model=d_model)
    for step in (1, 100, 3999, 4000, 4001, 20000, 100000):
        paper = d_model**-0.5 * min(step**-0.5, step * warmup**-1.5)
        assert float(schedule(step - 1)) == pytest.approx(paper, rel=1e-5)
    # The peak is at the end of warmup: d_model^-0.5 * warmup^-0.5 ~= 7.0e-4 for the base model.
    assert float(schedule(warmup - 1)) == pytest.approx(1 / math.sqrt(512 * 4000), rel=1e-5)
    cfg = OptimizerConfig(lr=2.0, schedule="inverse_sqrt", warmup_steps=warmup)
    assert float(make_schedule(cfg, total_steps=10, d_model=d_model)(9)) == pytest.approx(
        2.0 * d_model**-0.5 * 10 * warmup**-1.5, rel=1e-5
    )


def test_weight_decay_applies_to_kernels_only_by_default():
    cfg = ModelConfig.from_preset("gpt2-tiny", d_model=16, num_heads=2, d_ff=32, vocab_size=32)
    model = build_model(cfg, rngs=nnx.Rngs(0))
    params = nnx.state(model, nnx.Param)
    flat = {
        ".".join(map(str, path)): bool(variable.get_value())
        for path, variable in nnx.to_flat_state(weight_decay_mask(params))
    }
    assert flat and all(decays == path.endswith("kernel") for path, decays in flat.items())
    with_tables = nnx.to_flat_state(weight_decay_mask(params, decay_embeddings=True))
    assert {".".join(map(str, p)) for p, v in with_tables if v.get_value()} == {
        path for path in flat if path.endswith(("kernel", "embedding"))
    }

    # One AdamW step with zero gradients: only the masked parameters shrink, by lr * wd.
    tx, _ = make_optimizer(
        OptimizerConfig(lr=0.1, schedule="constant", warmup_steps=0, weight_decay=0.5),
        cfg,
        total_steps=10,
    )
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    before = jax.tree.map(np.asarray, nnx.state(model, nnx.Param))
    optimizer.update(model, jax.tree.map(jnp.zeros_like, nnx.state(model, nnx.Param)))
    after = nnx.state(model, nnx.Param)
    for (path, old), (_, new) in zip(
        nnx.to_flat_state(before), nnx.to_flat_state(after), strict=True
    ):
        factor = 1 - 0.1 * 0.5 if path[-1] == "kernel" else 1.0
        np.testing.assert_allclose(new[...], old[...] * factor, rtol=1e-6, atol=1e-7)


def test_clipping_bounds_the_global_norm():
    """Two steps, a huge gradient then a small one: with clipping, the updates equal those of
    the unclipped optimizer fed the gradients clipped to global norm 1 (Adam's first step alone
    would not show it: it is invariant to the gradient's scale)."""
    params = {"kernel": jnp.zeros(4)}
    grads = [{"kernel": jnp.full(4, 100.0)}, {"kernel": jnp.full(4, 0.1)}]
    clipped_grads = [{"kernel": jnp.full(4, 0.5)}, grads[1]]  # norms 200 -> 1; 0.2 stays
    cfg = OptimizerConfig(lr=1.0, schedule="constant", warmup_steps=0, clip_norm=1.0)
    unclipped = OptimizerConfig(**{**cfg.__dict__, "clip_norm": None})

    def updates(cfg, grads):
        tx, _ = make_optimizer(cfg, ModelConfig.from_preset("gpt2-tiny"), total_steps=2)
        state, out = tx.init(params), []
        for g in grads:
            update, state = tx.update(g, state, params)
            out.append(np.asarray(update["kernel"]))
        return out

    with_clipping = updates(cfg, grads)
    np.testing.assert_allclose(with_clipping, updates(unclipped, clipped_grads), rtol=1e-6)
    assert not np.allclose(with_clipping[1], updates(unclipped, grads)[1], rtol=1e-2)


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(schedule="noam"), "optimizer.schedule must be one of"),
        (dict(lr=-1.0), "optimizer.lr"),
        (dict(b2=1.0), "b1 and b2"),
        (dict(warmup_steps=-1), "warmup_steps"),
        (dict(schedule="inverse_sqrt", warmup_steps=0), "warmup_steps >= 1"),
        (dict(clip_norm=0.0), "clip_norm"),
    ],
)
def test_invalid_optimizer_configs_name_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        OptimizerConfig(**fields)


@pytest.mark.parametrize("schedule", ["cosine", "linear", "constant"])
def test_warmup_longer_than_the_run_is_shortened_to_a_tenth_of_it(schedule):
    cfg = OptimizerConfig(lr=1.0, schedule=schedule, warmup_steps=100, end_lr_ratio=0.0)
    lrs = np.array([make_schedule(cfg, total_steps=50, d_model=8)(n) for n in range(50)])
    np.testing.assert_allclose(lrs[:6], [0.0, 0.2, 0.4, 0.6, 0.8, 1.0], atol=1e-6)
    assert lrs.max() == pytest.approx(1.0)
    assert fitted_warmup_steps(cfg, 50) == 5 and fitted_warmup_steps(cfg, 101) == 100
    assert warmup_notice(cfg, 50) == (
        "optimizer.warmup_steps (100) is longer than the schedule's 50 steps: warming up over 5 "
        "steps instead"
    )
    assert warmup_notice(cfg, 101) is None


def test_a_run_of_fewer_than_ten_steps_has_no_warmup():
    cfg = OptimizerConfig(lr=1.0, schedule="cosine", warmup_steps=100, end_lr_ratio=0.0)
    assert float(make_schedule(cfg, total_steps=3, d_model=8)(0)) == pytest.approx(1.0)


@pytest.mark.parametrize("schedule", ["cosine", "linear", "constant"])
def test_a_warmup_as_long_as_the_run_is_shortened_as_a_longer_one(schedule):
    """train.steps == warmup_steps (``python train.py train.steps=100``): a warmup to the last
    step would leave no decay (and reach lr only at the end); it is a tenth of the run instead,
    said, as for a run one step shorter."""
    cfg = OptimizerConfig(lr=2.0, schedule=schedule, warmup_steps=100, end_lr_ratio=0.1)
    assert warmup_notice(cfg, 100) == (
        "optimizer.warmup_steps (100) is as long as the schedule's 100 steps: warming up over 10 "
        "steps instead"
    )
    as_long = values(make_schedule(cfg, total_steps=100, d_model=8), np.arange(100))
    assert as_long[10] == pytest.approx(2.0) and as_long[:10].max() < 2.0
    if schedule != "constant":
        assert as_long[99] < 0.3  # it decays to near its end value, 0.2
    assert fitted_warmup_steps(cfg, 99) == 9
