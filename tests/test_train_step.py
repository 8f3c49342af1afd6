"""The jitted train/eval steps: each task learns, accumulation is exact, NaN steps are skipped."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from flaxformer_lite import parallel
from flaxformer_lite.data.tasks import TASKS
from flaxformer_lite.models import ModelConfig, build_model
from flaxformer_lite.train.config import load_config, task_of
from flaxformer_lite.train.optim import make_optimizer
from flaxformer_lite.train.program import (
    build_train_state,
    configured_train_step,
    resolve_mesh,
    tracing_layout,
    train_and_eval_graphdefs,
)
from flaxformer_lite.train.sections import OptimizerConfig
from flaxformer_lite.train.step import make_eval_step, make_train_step, model_loss
from flaxformer_lite.train.step_numbers import step_numbers

pytestmark = pytest.mark.fast_compile  # XLA's backend optimizations off: conftest.py

SMALL = dict(
    d_model=32,
    num_heads=4,
    d_ff=64,
    vocab_size=32,
    max_length=16,
    embedding_dropout=0.0,
    attention_dropout=0.0,
    residual_dropout=0.0,
)
B, T = 4, 8


def setup(preset, **overrides):
    cfg = ModelConfig.from_preset(preset, **{**SMALL, **overrides})
    model = build_model(cfg, rngs=nnx.Rngs(0))
    tx, _ = make_optimizer(
        OptimizerConfig(lr=1e-2, schedule="constant", warmup_steps=0), cfg, total_steps=100
    )
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    return cfg, model, optimizer


def snapshot(state):
    """The state as numpy arrays (PRNG keys as their key data), safe from donation."""

    def leaf(x):
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        return np.array(x)

    return jax.tree.map(leaf, nnx.to_pure_dict(state))


def make_batch(task, seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, 32, (B, T + 1)).astype(np.int32)
    weights = np.ones((B, T), np.float32)
    weights[1, 5:] = 0.0  # padding
    mask = weights > 0
    if task == "lm":
        return dict(inputs=ids[:, :-1], targets=ids[:, 1:], weights=weights)
    if task == "seq2seq":
        return dict(
            src=ids[:, 1:], src_mask=mask, inputs=ids[:, :-1], targets=ids[:, 1:], weights=weights
        )
    if task == "mlm":
        masked = ids[:, :-1].copy()
        masked[:, ::3] = 1
        return dict(inputs=masked, targets=ids[:, :-1], weights=(masked == 1) * weights, mask=mask)
    return dict(inputs=ids[:, :-1], mask=mask, labels=(ids[:, 0] % 2).astype(np.int32))


@pytest.mark.parametrize(
    "preset, overrides",
    [
        ("gpt2-tiny", {}),
        ("transformer-tiny", {}),
        ("bert-tiny", {}),
        ("bert-tiny", dict(num_classes=2)),
    ],
)
def test_each_task_learns_its_batch(preset, overrides):
    cfg, model, optimizer = setup(preset, **overrides)
    task = task_of(cfg)
    graphdef, state = nnx.split((model, optimizer))
    step = make_train_step(graphdef, task=task)
    batch = make_batch(task.name)
    losses = []
    for _ in range(12):
        state, metrics = step(state, batch)
        assert bool(metrics["finite"])
        losses.append(float(metrics["loss"]))
    assert losses[-1] < 0.5 * losses[0], losses
    if task.name != "classify":
        assert float(metrics["num_tokens"]) == batch["weights"].sum()


def test_tasks_follow_the_model_kind():
    assert [
        task_of(ModelConfig.from_preset(p)).name
        for p in ("gpt2-tiny", "transformer-tiny", "bert-tiny")
    ] == ["lm", "seq2seq", "mlm"]
    assert task_of(ModelConfig.from_preset("bert-tiny", num_classes=3)).name == "classify"


def test_gradient_accumulation_equals_the_whole_batch():
    """Compared after one SGD step, which (unlike Adam's first step) is linear in the gradient."""

    def sgd_setup():
        model = setup("gpt2-tiny")[1]
        return model, nnx.Optimizer(model, optax.sgd(0.5), wrt=nnx.Param)

    graphdef, state = nnx.split(sgd_setup())
    copy = nnx.split(sgd_setup())[1]  # the same seeds: the same state
    batch = make_batch("lm")
    whole, whole_metrics = make_train_step(graphdef, task=TASKS["lm"])(state, batch)
    parts, parts_metrics = make_train_step(graphdef, task=TASKS["lm"], grad_accum_steps=2)(
        copy, batch
    )
    for key in ("loss", "accuracy", "num_tokens", "grad_norm"):
        np.testing.assert_allclose(parts_metrics[key], whole_metrics[key], rtol=1e-5)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6),
        snapshot(parts),
        snapshot(whole),
    )
    with pytest.raises(ValueError, match="not divisible by grad_accum_steps=3"):
        make_train_step(graphdef, task=TASKS["lm"], grad_accum_steps=3)(parts, batch)


@pytest.mark.parametrize(
    "preset, overrides",
    [
        ("gpt2-tiny", dict(attention_dropout=0.1, residual_dropout=0.1)),  # the same masks
        pytest.param("llama-tiny", dict(dtype="bfloat16"), marks=pytest.mark.slow),
        pytest.param("transformer-tiny", {}, marks=pytest.mark.slow),
        pytest.param("bert-tiny", {}, marks=pytest.mark.slow),
    ],
)
def test_a_chunked_loss_step_equals_the_plain_step(preset, overrides):
    """``loss_chunk=3`` (not a divisor of T = 8), label smoothing and z-loss: the same metrics and
    (in float32) the same updated state as the whole-batch loss."""
    cfg, model, optimizer = setup(preset, **{**SMALL, "vocab_size": 32, **overrides})
    graphdef, state = nnx.split((model, optimizer))
    copy = jax.tree.map(jnp.copy, state)
    batch, task = make_batch(task_of(cfg).name), task_of(cfg)
    loss = dict(task=task, label_smoothing=0.1, z_loss=1e-3)
    plain, plain_metrics = make_train_step(graphdef, **loss)(state, batch)
    chunked, chunked_metrics = make_train_step(graphdef, **loss, loss_chunk=3)(copy, batch)
    rtol = 1e-2 if cfg.dtype == "bfloat16" else 1e-5
    for key in ("loss", "z_loss", "accuracy", "num_tokens", "grad_norm"):
        np.testing.assert_allclose(chunked_metrics[key], plain_metrics[key], rtol=rtol, err_msg=key)
    _, eval_graphdef = train_and_eval_graphdefs(graphdef, chunked)  # dropout off
    plain_eval = make_eval_step(eval_graphdef, task=task)(chunked, batch)
    chunked_eval = make_eval_step(eval_graphdef, task=task, loss_chunk=3)(chunked, batch)
    for key in ("loss", "accuracy", "num_tokens"):
        np.testing.assert_allclose(chunked_eval[key], plain_eval[key], rtol=rtol, err_msg=key)
    # Adam's first step is lr * g / (|g| + eps) = lr * sign(g) but for tiny gradients, whose
    # round-off it scales up: within a thousandth of a step (lr = 1e-2). bf16 rounding flips
    # the sign of such a step.
    if cfg.dtype == "float32":
        jax.tree.map(
            lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5),
            snapshot(chunked),
            snapshot(plain),
        )


def test_a_non_finite_step_leaves_the_state_unchanged():
    _, model, optimizer = setup("gpt2-tiny")
    model.embed.tokens.embedding[...] = model.embed.tokens.embedding[...].at[5].set(jnp.inf)
    graphdef, state = nnx.split((model, optimizer))
    before = snapshot(state)
    batch = make_batch("lm")
    batch["inputs"][0, 0] = 5
    state, metrics = make_train_step(graphdef, task=TASKS["lm"])(state, batch)
    assert not bool(metrics["finite"])
    jax.tree.map(np.testing.assert_array_equal, snapshot(state), before)


def test_the_update_overwrites_the_donated_state_in_place():
    # Parameters dominate this model's memory (a 4096 x 128 table, 32 tokens). The bound lies
    # between what the in-place update needs (gradients, the tied table's two gradient terms,
    # activations) and what choosing between an updated copy and the old state needed.
    _, model, optimizer = setup("gpt2-tiny", d_model=128, d_ff=512, vocab_size=4096)
    graphdef, state = nnx.split((model, optimizer))
    param_bytes = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    compiled = make_train_step(graphdef, task=TASKS["lm"]).lower(state, make_batch("lm")).compile()
    memory = compiled.memory_analysis()
    batch_bytes = sum(x.nbytes for x in make_batch("lm").values())
    assert memory.alias_size_in_bytes == memory.argument_size_in_bytes - batch_bytes
    assert memory.temp_size_in_bytes < 2.5 * param_bytes


def test_the_step_over_the_states_leaves_is_the_same_step():
    _, model, optimizer = setup("gpt2-tiny")
    graphdef, state = nnx.split((model, optimizer))
    leaves, treedef = jax.tree.flatten(jax.tree.map(jnp.copy, state))
    batch = make_batch("lm")
    state, metrics = make_train_step(graphdef, task=TASKS["lm"])(state, batch)
    on_leaves = make_train_step(graphdef, task=TASKS["lm"], state_treedef=treedef)
    leaves, leaf_metrics = on_leaves(leaves, batch)
    assert isinstance(leaves, list)
    for key in ("loss", "grad_norm", "finite"):
        np.testing.assert_allclose(leaf_metrics[key], metrics[key], rtol=1e-6, err_msg=key)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7),
        snapshot(treedef.unflatten(leaves)),
        snapshot(state),
    )
    memory = on_leaves.lower(leaves, batch).compile().memory_analysis()  # donated, as the state
    batch_bytes = sum(x.nbytes for x in batch.values())
    assert memory.alias_size_in_bytes == memory.argument_size_in_bytes - batch_bytes


def test_eval_step_is_the_loss_without_dropout():
    cfg, model, optimizer = setup("gpt2-tiny", residual_dropout=0.3)
    batch = make_batch("lm")
    model.eval()
    eval_graphdef, state = nnx.split((model, optimizer))
    metrics = make_eval_step(eval_graphdef, task=TASKS["lm"])(state, batch)
    expected = model_loss(model, jax.tree.map(jnp.asarray, batch), task=TASKS["lm"])[1]
    np.testing.assert_allclose(metrics["loss"], expected["loss"], rtol=1e-5)
    again = make_eval_step(eval_graphdef, task=TASKS["lm"])(state, batch)
    np.testing.assert_array_equal(again["loss"], metrics["loss"])


def step_program_ops(num_layers, scan_layers):
    """The number of StableHLO ops in the lowered train step of a ``num_layers`` decoder LM."""
    _, model, optimizer = setup("gpt2-tiny", num_decoder_layers=num_layers, scan_layers=scan_layers)
    graphdef, state = nnx.split((model, optimizer))
    lowered = make_train_step(graphdef, task=TASKS["lm"]).lower(state, make_batch("lm"))
    return lowered.as_text().count("stablehlo.")


def test_a_scanned_stack_is_one_program_whatever_its_depth():
    # What XLA compiles does not grow with depth, so neither does compile time
    # (benchmarks/train_step.py --scan-layers reports it).
    assert step_program_ops(24, scan_layers=True) == step_program_ops(2, scan_layers=True)
    assert step_program_ops(6, scan_layers=False) > 2 * step_program_ops(2, scan_layers=False)


@pytest.mark.parametrize(
    "preset, overrides, packed",
    [
        ("gpt2-tiny", {}, False),
        ("gpt2-tiny", {}, True),
        ("transformer-tiny", {}, False),
        ("bert-tiny", {}, False),
        ("bert-tiny", dict(num_classes=2), False),
    ],
)
def test_the_loss_reads_every_array_of_the_tasks_batch(preset, overrides, packed):
    """A batch as :mod:`flaxformer_lite.data.tasks` describes it: the loss reads each array (a
    changed array changes the loss) and needs no other."""
    cfg, model, _ = setup(preset, **overrides)
    task = task_of(cfg)
    rng = np.random.default_rng(0)
    batch = {}
    for key, (shape, dtype) in task.batch_shapes(packed=packed, batch_size=B, seq_len=T).items():
        values = rng.integers(0, 2 if key == "labels" else 32, shape)
        batch[key] = values > 8 if dtype == np.bool_ else values.astype(dtype)
    if packed:
        halves = np.arange(T) // (T // 2)  # two segments a row
        batch["segment_ids"] = np.tile(1 + halves, (B, 1)).astype(np.int32)
        batch["positions"] = np.tile(np.arange(T) % (T // 2), (B, 1)).astype(np.int32)
    loss_of = nnx.jit(lambda model, batch: model_loss(model, batch, task=task)[0])
    loss = float(loss_of(model, batch))
    for key, value in batch.items():
        if key in ("segment_ids", "positions"):  # one segment: positions from 0 to T
            value = np.zeros_like(value) + (key == "segment_ids")
        elif key == "labels":
            value = 1 - value
        elif value.ndim == 1:
            value = np.where(np.arange(B) == 0, 0, value)
        else:
            value = np.roll(value, 1, axis=-1)
        changed = dict(batch, **{key: value})
        assert float(loss_of(model, changed)) != loss, key


@pytest.mark.slow  # two sharded train steps compiled on 8 CPU devices
def test_a_chunked_loss_step_equals_the_plain_step_under_fsdp_and_tensor_parallelism():
    """The head's parameters are gathered over fsdp before the blocks (its vocabulary stays split
    over tensor): the same metrics as the whole-batch loss on the same mesh."""
    overrides = ["mesh.data=1", "mesh.fsdp=4", "mesh.tensor=2", "train.batch_size=8"]
    metrics = {}
    for chunk in ("null", "3"):
        cfg, mesh = resolve_mesh(load_config(None, [*overrides, f"train.loss_chunk={chunk}"]))
        built = build_train_state(cfg, mesh, abstract=False)
        batch = jax.device_put(make_batch("lm"), parallel.batch_sharding(mesh, cfg.mesh.rules))
        with tracing_layout(mesh, cfg.mesh.rules):
            step = configured_train_step(cfg, built.graphdef, built.shardings)
            numbers = step_numbers(cfg, built.schedule)
            _, metrics[chunk], _ = step(built.state, batch, numbers, True)
    for key in ("loss", "accuracy", "num_tokens", "grad_norm"):
        np.testing.assert_allclose(metrics["3"][key], metrics["null"][key], rtol=1e-5, err_msg=key)
