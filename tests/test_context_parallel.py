"""Context parallelism (mesh.context): each sequence split zig-zag over devices, K/V gathered in
attention. Training on context meshes gives the losses and gradients of one device.

The 8 devices are the simulated CPU devices of conftest.py; the one-device baseline runs on the
first of them.
"""

import dataclasses
import functools
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from attention_cases import dense_bool_shapes
from flax import nnx

from flaxformer_lite import ops
from flaxformer_lite.cli import main
from flaxformer_lite.data.tasks import TASKS
from flaxformer_lite.models import ModelConfig, build_model
from flaxformer_lite.nn.context_parallel import (
    context_attention,
    natural_order,
    to_context_layout,
    zigzag_order,
)
from flaxformer_lite.ops.attention_choice import CHUNKED, XLA
from flaxformer_lite.ops.attention_inputs import validated_call
from flaxformer_lite.parallel import (
    DEFAULT_RULES,
    abstract_sharded,
    batch_sharding,
    create_sharded,
    make_mesh,
)
from flaxformer_lite.train.checkpoint import Checkpointer
from flaxformer_lite.train.checkpoint_format import from_savable, restore_target, to_savable
from flaxformer_lite.train.config import ConfigError, load_config
from flaxformer_lite.train.program import tracing_layout
from flaxformer_lite.train.step import make_train_step, model_loss

pytestmark = pytest.mark.fast_compile  # XLA's backend optimizations off: conftest.py

B, T, VOCAB, STEPS = 4, 32, 64, 5
NO_DROPOUT = dict(embedding_dropout=0.0, attention_dropout=0.0, residual_dropout=0.0)


# --------------------------------------------------------------------------- the layout
def test_zigzag_gives_each_shard_an_early_and_a_late_block():
    order = zigzag_order(16, 4)  # 8 blocks of 2
    shards = order.reshape(4, 2, 2)
    for i in range(4):
        np.testing.assert_array_equal(shards[i, 0], [2 * i, 2 * i + 1])
        np.testing.assert_array_equal(shards[i, 1], [2 * (7 - i), 2 * (7 - i) + 1])
    np.testing.assert_array_equal(np.sort(order), np.arange(16))
    np.testing.assert_array_equal(zigzag_order(7, 1), np.arange(7))
    x = jnp.arange(2 * 16 * 3).reshape(2, 16, 3)
    np.testing.assert_array_equal(natural_order(x[:, order], 4, axis=1), x)
    with pytest.raises(ValueError, match=r"length 20 does not split over mesh.context=4"):
        zigzag_order(20, 4)


def test_layout_moves_every_token_array_and_adds_true_positions():
    batch = dict(inputs=jnp.arange(2 * 8).reshape(2, 8), weights=jnp.ones((2, 8)))
    laid = to_context_layout(batch, 2)
    order = zigzag_order(8, 2)
    np.testing.assert_array_equal(laid["inputs"], batch["inputs"][:, order])
    np.testing.assert_array_equal(laid["positions"], np.broadcast_to(order, (2, 8)))


def test_query_positions_mask_is_the_rows_of_the_whole_mask():
    """A query at a given position sees the keys its row of the aligned mask shows."""
    positions = jnp.asarray([5, 0, 7, 2])
    for pieces in (
        dict(is_causal=True),
        dict(is_causal=True, local_window=(2, 0)),
        dict(is_causal=True, local_window=(1, 0), global_tokens=2),
        dict(local_window=(1, 2), global_tokens=1),
    ):
        whole = ops.AttentionMask(**pieces).positional(8, 8)[0, 0]
        rows = ops.AttentionMask(**pieces, query_positions=positions).positional(4, 8)
        np.testing.assert_array_equal(rows[0, 0], whole[positions])


@pytest.mark.parametrize(
    "pieces",
    [
        dict(is_causal=True),
        dict(is_causal=True, local_window=(3, 0), global_tokens=2),
        dict(local_window=(2, 3)),
    ],
    ids=["causal", "causal_window_global", "window"],
)
def test_chunked_attention_takes_query_positions_as_they_are(pieces):
    """ "chunked" reads the queries' positions block by block (no [T, S] mask): its values and
    gradients are the reference's with the whole mask's rows at those positions."""
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(2, n, 4, 8)), jnp.float32) for n in (12, 24, 24))
    positions = jnp.asarray(zigzag_order(24, 2).reshape(2, 12)[0])  # 0-5 and 18-23
    mask = ops.AttentionMask(**pieces, query_positions=positions)

    call = validated_call(q, k, v, None, mask)
    assert CHUNKED.sees(call).mask.explicit is None  # nothing folded for chunked
    assert XLA.sees(call).mask.explicit is not None

    def chunked(q, k, v):
        flags = dict(is_causal=False, local_window=None, global_tokens=0)
        flags.update({name: value for name, value in pieces.items()})
        return ops.chunked_attention(
            q, k, v, **flags, query_positions=positions, block_q=4, block_k=8
        )

    def outputs_and_grads(attention):
        def f(q, k, v):
            out = attention(q, k, v)
            return (out * jnp.cos(out)).sum(), out

        return jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True)(q, k, v)

    (_, want), want_grads = outputs_and_grads(
        lambda q, k, v: ops.reference_attention(q, k, v, mask=mask)
    )
    (_, got), got_grads = outputs_and_grads(chunked)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    for g, w in zip(got_grads, want_grads, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


def context_attention_in_order(shards, implementation, q, k, v, mask):
    """``context_attention`` over the active mesh's context axis (``shards`` devices) of inputs
    and a mask in position order, its output back in position order."""
    order = zigzag_order(q.shape[1], shards)

    def laid_out(x, axis):  # the T and S axes of a mask, where they are whole
        return x if x.shape[axis] == 1 else jnp.take(x, order, axis=axis)

    laid = dict(explicit=None, segment_ids=None)
    if mask.explicit is not None:
        laid["explicit"] = laid_out(laid_out(mask.explicit, 2), 3)
    if mask.segment_ids is not None:
        laid["segment_ids"] = tuple(laid_out(x, 1) for x in mask.segment_ids)
    attend = functools.partial(
        context_attention,
        mask=dataclasses.replace(mask, **laid),
        axes=("context",),
        implementation=implementation,
        bias=None,
    )
    return natural_order(attend(q[:, order], k[:, order], v[:, order]), shards, axis=1)


@pytest.mark.parametrize("implementation", ["chunked", "xla"])
@pytest.mark.parametrize("padding", ["keys", "queries_and_keys"])
def test_context_attention_with_padding_and_segments_equals_one_device(implementation, padding):
    """The explicit mask (a key padding mask ``[B, 1, 1, S]``, or query and key padding
    ``[B, 1, T, S]``, split along T) beside packed rows' segment ids, over context 4: the values
    and gradients of one device."""
    rng = np.random.default_rng(0)
    b, t = 2, 32
    q, k, v = (jnp.asarray(rng.normal(size=(b, t, h, 8)), jnp.float32) for h in (4, 2, 2))
    valid = jnp.asarray(rng.random((b, t)) < 0.8)
    ids = jnp.asarray(np.sort(rng.integers(1, 4, (b, t)), axis=1))
    explicit = valid[:, None, None, :] if padding == "keys" else ops.padding_mask(valid)
    mask = ops.AttentionMask(is_causal=True, segment_ids=(ids, ids), explicit=explicit)
    mesh = make_mesh(1, 1, 1, context=4, devices=jax.devices()[:4])

    def outputs_and_grads(attention):
        def f(q, k, v):
            out = attention(q, k, v)
            return (out * jnp.cos(out)).sum(), out

        return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))(q, k, v)

    (_, want), want_grads = outputs_and_grads(
        lambda q, k, v: ops.dot_product_attention(q, k, v, mask=mask, implementation="xla")
    )
    with jax.set_mesh(mesh):
        (_, got), got_grads = outputs_and_grads(
            lambda q, k, v: context_attention_in_order(4, implementation, q, k, v, mask)
        )
    np.testing.assert_allclose(got, want, atol=1e-5)
    for g, w in zip(got_grads, want_grads, strict=True):
        np.testing.assert_allclose(g, w, atol=1e-5)


def test_context_attention_passes_segment_ids_to_chunked_as_ids():
    """Over context 4, each device's 512 queries meet the 2,048 gathered keys' segment ids block
    by block in "chunked": no ``[T / C, S]`` mask of them, forward or backward."""
    t, shards = 2048, 4
    mesh = make_mesh(1, 1, 1, context=shards, devices=jax.devices()[:shards])
    x = jax.ShapeDtypeStruct((1, t, 2, 16), jnp.float32)
    ids = jax.ShapeDtypeStruct((1, t), jnp.int32)

    def loss(q, ids):
        mask = ops.AttentionMask(is_causal=True, segment_ids=(ids, ids))
        attend = functools.partial(context_attention, axes=("context",), implementation="chunked")
        return jnp.sum(attend(q, q, q, None, mask))

    with jax.set_mesh(mesh):
        text = jax.jit(jax.value_and_grad(loss)).lower(x, ids).as_text()
    assert dense_bool_shapes(text, t // shards, t // shards)  # the blocks' masks are there
    assert dense_bool_shapes(text, t // shards, t) == []


# --------------------------------------------------------------------------- exactness
def lm_batch(seed, packed):
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, VOCAB, (B, T + 1)).astype(np.int32)
    batch = dict(inputs=ids[:, :-1], targets=ids[:, 1:], weights=np.ones((B, T), np.float32))
    if packed:  # three documents per row, cut at different places; positions restart
        cuts = rng.integers(1, T, (B, 2))
        slots = np.arange(T)
        segment_ids = 1 + (slots >= cuts.min(1, keepdims=True)) + (slots >= cuts.max(1)[:, None])
        starts = np.where(np.diff(segment_ids, prepend=0, axis=1) != 0, slots, 0)
        batch["segment_ids"] = segment_ids.astype(np.int32)
        batch["positions"] = (slots - np.maximum.accumulate(starts, axis=1)).astype(np.int32)
    return batch


def train(cfg, mesh, packed, loss_chunk=None, rules=DEFAULT_RULES):
    """Losses and gradient norms of ``STEPS`` SGD steps, and what they added to each parameter
    (the sum of its gradients times the learning rate: every gradient, without a second
    program to compile)."""

    def create():
        model = build_model(cfg, rngs=nnx.Rngs(params=0, dropout=1))
        return model, nnx.Optimizer(model, optax.sgd(0.5), wrt=nnx.Param)

    graphdef, state, shardings = create_sharded(create, mesh, rules)
    batches = [
        jax.device_put(lm_batch(seed, packed), batch_sharding(mesh, rules)) for seed in range(STEPS)
    ]

    def params(state):
        return jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.filter_state(state[0], nnx.Param)))

    initial = params(state)
    with tracing_layout(mesh, rules):
        step = make_train_step(
            graphdef, task=TASKS["lm"], loss_chunk=loss_chunk, state_shardings=shardings
        )
        history = []
        for batch in batches:
            state, metrics = step(state, batch)
            history.append((float(metrics["loss"]), float(metrics["grad_norm"])))
    updates = jax.tree.map(np.subtract, params(state), initial)
    return np.asarray(history), updates


def assert_same_training(cfg, meshes, packed=False, loss_chunk=None, rules=DEFAULT_RULES):
    devices = jax.devices()
    want, want_updates = train(cfg, make_mesh(1, 1, 1, devices=devices[:1]), packed, loss_chunk)
    scale = max(float(np.abs(u).max()) for u in jax.tree.leaves(want_updates))
    for data, fsdp, tensor, context in meshes:
        used = devices[: data * fsdp * tensor * context]
        mesh = make_mesh(data, fsdp, tensor, context=context, devices=used)
        got, got_updates = train(cfg, mesh, packed, loss_chunk, rules)
        np.testing.assert_allclose(got, want, rtol=1e-5, err_msg=str(dict(mesh.shape)))
        for got_update, want_update in zip(
            jax.tree.leaves(got_updates), jax.tree.leaves(want_updates), strict=True
        ):
            np.testing.assert_allclose(got_update, want_update, rtol=1e-5, atol=1e-5 * scale)


def tiny(preset="gpt2-tiny", **overrides):
    return ModelConfig.from_preset(
        preset, vocab_size=VOCAB, max_length=T, num_decoder_layers=2, **{**NO_DROPOUT, **overrides}
    )


def test_causal_lm_with_packed_rows_trains_as_on_one_device():
    """Learned positions, packed rows (segment ids, positions restarting per document) on
    context 2 and 8, and context x data."""
    assert_same_training(tiny(), [(1, 1, 1, 2), (1, 1, 1, 8), (2, 1, 1, 4)], packed=True)


def test_sliding_window_with_global_tokens_trains_as_on_one_device():
    """A causal window with global tokens, the masks built from the true positions, in the
    chunked implementation on each device; context 4 and context x fsdp."""
    cfg = tiny(local_window=(5, 0), global_tokens=2, attention_implementation="chunked")
    assert_same_training(cfg, [(1, 1, 1, 4), (1, 2, 1, 4)])


def test_rope_with_grouped_heads_trains_as_on_one_device():
    """Llama-style: RoPE from the true positions, grouped KV heads, packed rows; context 4 and
    context x tensor."""
    cfg = tiny("llama-tiny", num_heads=4, num_kv_heads=2, d_model=32, d_ff=64)
    assert_same_training(cfg, [(1, 1, 1, 4), (1, 1, 2, 2)], packed=True)


def test_sequence_split_over_fsdp_and_context_trains_as_on_one_device():
    """The rule activation_length -> (fsdp, context) (batch on data only) splits each sequence
    over both axes while fsdp also splits the parameters: llama-style's long-context layout."""
    cfg = tiny("llama-tiny", num_heads=4, num_kv_heads=2, d_model=32, d_ff=64)
    rules = {**DEFAULT_RULES, "batch": ("data",), "activation_length": ("fsdp", "context")}
    assert_same_training(cfg, [(1, 2, 1, 2)], packed=True, rules=rules)


def test_relative_positions_and_chunked_loss_train_as_on_one_device():
    """T5's relative bias (queries in the layout order, keys in position order) and the loss
    a chunk of positions at a time."""
    cfg = tiny(positions="relative")
    assert_same_training(cfg, [(1, 1, 1, 4)], loss_chunk=8)


def test_context_step_gathers_only_keys_and_values():
    """The sequence stays split: the only all-gathers of the step (forward and backward, with
    the loss in blocks) are those of the keys and values, ``[B, T, H, Dh]``."""
    cfg = tiny()
    mesh = make_mesh(1, 1, 1, context=4, devices=jax.devices()[:4])
    graphdef, state, _ = create_sharded(
        lambda: (build_model(cfg, rngs=nnx.Rngs(0)),), mesh, DEFAULT_RULES
    )

    def grads(state, batch):
        (model,) = nnx.merge(graphdef, state)
        return nnx.grad(lambda m: model_loss(m, batch, task=TASKS["lm"], loss_chunk=8)[0])(model)

    batch = jax.device_put(lm_batch(0, False), batch_sharding(mesh, DEFAULT_RULES))
    with tracing_layout(mesh, DEFAULT_RULES):
        hlo = jax.jit(grads).lower(state, batch).compile().as_text()
    gathered = {shape.split("{")[0] for shape in re.findall(r"= (\S+) all-gather", hlo)}
    assert gathered == {f"f32[{B},{T},4,16]"}


def test_a_checkpoint_of_a_context_run_restores_on_other_meshes(tmp_path):
    """Parameters are not split by the context axis: a checkpoint written on context 4 restores
    onto one device and onto data 2 x context 2, and the next step has the same loss."""
    cfg = tiny()

    def create():
        model = build_model(cfg, rngs=nnx.Rngs(params=0, dropout=1))
        return model, nnx.Optimizer(model, optax.sgd(0.5), wrt=nnx.Param)

    def next_loss(mesh, step, state):
        with tracing_layout(mesh, DEFAULT_RULES):
            batch = jax.device_put(lm_batch(3, True), batch_sharding(mesh, DEFAULT_RULES))
            return float(step(state, batch)[1]["loss"])

    source = make_mesh(1, 1, 1, context=4, devices=jax.devices()[:4])
    graphdef, state, shardings = create_sharded(create, source, DEFAULT_RULES)
    step = make_train_step(graphdef, task=TASKS["lm"], state_shardings=shardings)
    with tracing_layout(source, DEFAULT_RULES):
        for seed in range(2):
            batch = jax.device_put(lm_batch(seed, True), batch_sharding(source, DEFAULT_RULES))
            state, _ = step(state, batch)
    with Checkpointer(tmp_path / "checkpoints", keep=1) as checkpointer:
        assert checkpointer.save(2, to_savable(state), data_state={}, config={}, force=True)
        checkpointer.wait()
    want = next_loss(source, step, state)
    targets = [
        make_mesh(1, 1, 1, devices=jax.devices()[:1]),
        make_mesh(2, 1, 1, context=2, devices=jax.devices()[:4]),
    ]
    with Checkpointer(tmp_path / "checkpoints", keep=1) as checkpointer:
        for mesh in targets:
            target_graphdef, abstract, target_shardings = abstract_sharded(
                create, mesh, DEFAULT_RULES
            )
            restored = from_savable(checkpointer.restore(restore_target(abstract)).state, abstract)
            target_step = make_train_step(
                target_graphdef, task=TASKS["lm"], state_shardings=target_shardings
            )
            got = next_loss(mesh, target_step, restored)
            assert abs(got - want) <= 1e-5 * abs(want), (dict(mesh.shape), got, want)


# --------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "overrides, message",
    [
        (["mesh.context=4", "data.seq_len=36"], r"data.seq_len 36 does not split over mesh.con"),
        (
            ["mesh.context=2", "model.preset=transformer-tiny"],
            r"mesh.context=2 splits the sequences of decoder models; model.kind is encoder_dec",
        ),
        (
            ["mesh.context=2", "model.mixer=aft_full"],
            r"mesh.context=2 with model.mixer=aft_full: only attention mixes tokens",
        ),
        (["mesh.context=0"], r"mesh.context must be a positive int or -1"),
    ],
)
def test_unsplittable_settings_are_config_errors(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def compile_cli(argv, capsys):
    status = main(["compile", *argv])
    out, err = capsys.readouterr()
    return status, out.strip().splitlines(), err.strip().splitlines()


COMPILE_TINY = ["train.batch_size=2", "data.seq_len=16", "--topology", "cpu-8"]


def test_compile_refuses_unsplittable_lengths_and_generation_in_one_line(capsys):
    status, out, err = compile_cli([*COMPILE_TINY, "mesh.context=4", "data.seq_len=36"], capsys)
    assert (status, out) == (2, [])
    assert err == [
        "error: data.seq_len 36 does not split over mesh.context=4: the zig-zag layout cuts "
        "each sequence into 2 x 4 = 8 equal blocks"
    ]
    status, out, err = compile_cli([*COMPILE_TINY, "--decode", "mesh.context=8"], capsys)
    assert (status, out, len(err)) == (2, [], 1)
    assert err[0].startswith("error: --decode with mesh.context=8: generation keeps")


def test_compile_reports_a_context_mesh(capsys):
    """mesh.context composes with data on the compile path: its mesh in the report."""
    status, out, _ = compile_cli([*COMPILE_TINY, "mesh.data=2", "mesh.context=4"], capsys)
    summary = json.loads(out[-1])
    assert status == 0 and summary["mesh"] == {"data": 2, "fsdp": 1, "context": 4, "tensor": 1}
    assert summary["collectives"]["all-gather"] > 0
