"""Low-rank adapters (``flaxformer_lite.nn.lora``): an adapter computes ``scale * dropout(x) A B``
(a float64 formula, multi-axis projections and a fused q/k/v too), fresh adapters leave the
model's function as it was, A is drawn as PEFT draws it, targets name projections by group, name
or path (one line naming the model's projections otherwise), the trainable count is
``r (in + out)`` per target, a scanned stack's adapters equal a loop stack's, merging keeps the
function, and a train step changes the adapters alone (the base bit for bit as it was), with
weight decay on them as on kernels."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from flaxformer_lite.data.tasks import TASKS
from flaxformer_lite.models import ModelConfig, build_model
from flaxformer_lite.nn import stack
from flaxformer_lite.nn.lora import (
    BASE,
    LoRA,
    add_adapters,
    has_adapters,
    lora_scale,
    merge_adapters,
    targeted,
    trainable,
)
from flaxformer_lite.nn.stack import stack_layer_states
from flaxformer_lite.train.config import load_config
from flaxformer_lite.train.optim import weight_decay_mask
from flaxformer_lite.train.program import make_train_state
from flaxformer_lite.train.step import train_step

pytestmark = pytest.mark.fast_compile  # XLA's backend optimizations off: conftest.py

IDS = np.random.default_rng(0).integers(0, 60, (2, 9))


def model_of(preset: str, *, scan: bool = False, **changes):
    cfg = dataclasses.replace(ModelConfig.from_preset(preset), scan_layers=scan, **changes)
    rngs = nnx.Rngs(params=0, dropout=1)
    return build_model(cfg, rngs=rngs), rngs


def randomized(model, seed: int = 3):
    """``model`` with every adapter factor drawn at random (B = 0 would hide A)."""
    state = nnx.state(model, nnx.LoRAParam)
    leaves, treedef = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    drawn = [0.3 * jax.random.normal(k, x.shape) for k, x in zip(keys, leaves, strict=True)]
    nnx.update(model, jax.tree.unflatten(treedef, drawn))
    return model


@pytest.mark.parametrize(
    "in_shape, out_shape", [((12,), (3, 2, 5)), ((2, 6), (12,))], ids=["fused_qkv", "out"]
)
@pytest.mark.parametrize("rslora", [False, True])
def test_an_adapter_computes_scale_times_x_a_b(in_shape, out_shape, rslora):
    scale = lora_scale(6.0, 4, rslora)
    assert scale == (6.0 / 2 if rslora else 6.0 / 4)
    lora = LoRA(
        in_shape,
        out_shape,
        in_names=(None,) * len(in_shape),
        out_names=(None,) * len(out_shape),
        rank=4,
        scale=scale,
        rngs=nnx.Rngs(0),
    )
    randomized(lora)
    x = np.random.default_rng(1).normal(size=(2, 3, *in_shape))
    a = np.asarray(lora.a[...], np.float64).reshape(math.prod(in_shape), 4)
    b = np.asarray(lora.b[...], np.float64).reshape(4, math.prod(out_shape))
    expected = scale * x.reshape(2, 3, -1) @ a @ b
    np.testing.assert_allclose(
        np.asarray(lora(jnp.asarray(x, jnp.float32))).reshape(2, 3, -1), expected, rtol=1e-5
    )
    np.testing.assert_allclose(
        np.asarray(lora.delta()).reshape(a.shape[0], -1), scale * a @ b, rtol=1e-5
    )


def test_a_is_drawn_as_peft_draws_it_and_b_is_zero():
    """PEFT: ``kaiming_uniform_(A, a=sqrt(5))``, a bound of ``1 / sqrt(in)``; ``B = 0``."""
    names = {"in_names": (None,), "out_names": (None,)}
    lora = LoRA((256,), (64,), **names, rank=64, scale=1.0, rngs=nnx.Rngs(0))
    a = np.asarray(lora.a[...])
    bound = 1 / math.sqrt(256)
    assert np.abs(a).max() <= bound and np.abs(a).max() > 0.99 * bound
    assert a.std() == pytest.approx(bound / math.sqrt(3), rel=0.03)  # uniform's std
    assert not np.asarray(lora.b[...]).any()


@pytest.mark.parametrize("preset", ["gpt2-tiny", "llama-tiny", "transformer-tiny", "bert-tiny"])
def test_fresh_adapters_keep_the_function_and_count_r_times_in_plus_out(preset):
    model, rngs = model_of(preset)
    model.eval()
    before = model(IDS) if preset != "transformer-tiny" else model(IDS, IDS)
    chosen = targeted(model, ["attention", "mlp"])
    paths = add_adapters(model, rank=3, alpha=6, targets=["attention", "mlp"], rngs=rngs)
    assert paths == list(chosen) and has_adapters(model)
    model.eval()
    after = model(IDS) if preset != "transformer-tiny" else model(IDS, IDS)
    np.testing.assert_array_equal(np.asarray(after), np.asarray(before))
    expected = sum(3 * (math.prod(d.in_shape) + math.prod(d.out_shape)) for d in chosen.values())
    adapters = nnx.state(model, nnx.LoRAParam)
    assert sum(x.size for x in jax.tree.leaves(adapters)) == expected
    # every projection of attention and the MLP, nothing else (BERT's head transform stays)
    assert {p.split(".")[-2] for p in paths} <= {"self_attention", "cross_attention", "mlp"}
    assert trainable(model) is nnx.LoRAParam


def test_targets_by_group_name_and_path_and_the_errors_that_name_the_model_s_projections():
    model, _ = model_of("transformer-tiny")
    assert {p.rsplit(".", 1)[1] for p in targeted(model, ["mlp"])} == {"wi", "wo"}
    queries = targeted(model, ["query"])
    assert {p.split(".")[-2] for p in queries} == {"self_attention", "cross_attention"}
    cross = targeted(model, ["cross_attention.query"])
    assert cross and all("cross_attention.query" in p for p in cross)
    cfg = model.config
    layers = cfg.num_encoder_layers + cfg.num_decoder_layers
    assert len(targeted(model, ["self_attention"])) == 4 * layers  # query, key, value, out
    with pytest.raises(ValueError, match=r"'c_attn' names no projection .*key, out, query"):
        targeted(model, ["c_attn"])
    gpt2, rngs = model_of("gpt2-tiny")
    with pytest.raises(ValueError, match=r"'query' names no projection .*out, qkv, wi, wo"):
        add_adapters(gpt2, rank=2, alpha=2, targets=["query"], rngs=rngs)
    with pytest.raises(ValueError, match=r"lora.rank=65 is larger than the matrix .*64 x 256"):
        add_adapters(gpt2, rank=65, alpha=2, targets=["mlp"], rngs=rngs)
    with pytest.raises(ValueError, match="at least 1"):
        add_adapters(gpt2, rank=0, alpha=2, targets=["mlp"], rngs=rngs)
    assert not has_adapters(gpt2)  # refused before any was added


def test_a_scanned_stack_s_adapters_equal_a_loop_stack_s_and_merging_keeps_the_function():
    loop, rngs = model_of("llama-tiny")
    add_adapters(loop, rank=2, alpha=4, targets=["attention", "mlp"], rngs=rngs)
    randomized(loop)
    scanned, rngs = model_of("llama-tiny", scan=True)
    add_adapters(scanned, rank=2, alpha=4, targets=["attention", "mlp"], rngs=rngs)
    a = nnx.state(scanned.decoder.layers.layers, nnx.LoRAParam)
    assert a["mlp"]["wi"]["lora"]["a"].get_metadata()["out_sharding"] == ("layers", "embed", None)
    layers = [nnx.state(layer, nnx.Param) for layer in loop.decoder.layers.layers]
    nnx.update(scanned.decoder.layers.layers, stack_layer_states(layers))
    outside = [
        (p, v) for p, v in nnx.to_flat_state(nnx.state(loop, nnx.Param)) if "layers" not in p
    ]
    nnx.update(scanned, nnx.from_flat_state(outside))
    for model in (loop, scanned):
        model.eval()
    expected = np.asarray(loop(IDS))
    np.testing.assert_allclose(np.asarray(scanned(IDS)), expected, rtol=1e-5, atol=1e-5)
    for model in (loop, scanned):
        assert merge_adapters(model) == (7 * 2 if model is loop else 7)
        assert not has_adapters(model)
        np.testing.assert_allclose(np.asarray(model(IDS)), expected, rtol=1e-4, atol=1e-5)


def test_adapter_dropout_drops_in_training_and_not_in_evaluation():
    model, rngs = model_of("gpt2-tiny")
    add_adapters(model, rank=2, alpha=2, targets=["mlp"], dropout_rate=0.5, rngs=rngs)
    randomized(model)
    dense = model.decoder.layers.layers[0].mlp.wi
    x = jnp.ones((4, 64))
    model.eval()
    expected = x @ dense.kernel[...] + dense.bias[...] + dense.lora.delta().sum(0)
    np.testing.assert_allclose(dense(x), expected, rtol=1e-5, atol=1e-6)
    model.train()
    assert not np.allclose(dense(x), dense(x))  # a fresh mask at each call


def test_a_train_step_changes_the_adapters_alone_with_decay_as_kernels():
    cfg = load_config(None, ["lora.rank=2", "model.vocab_size=64"])
    model, optimizer = make_train_state(cfg, optax.adamw(1e-2))
    assert optimizer.wrt is nnx.LoRAParam
    # The optimizer's moments: the adapters' shapes alone.
    moments = [x.size for x in jax.tree.leaves(nnx.state(optimizer, nnx.OptState))]
    adapters = [x.size for x in jax.tree.leaves(nnx.state(model, nnx.LoRAParam))]
    assert sum(moments) == 2 * sum(adapters) + 2  # mu, nu; Adam's count, the step
    mask = weight_decay_mask(nnx.state(model, nnx.LoRAParam))
    assert all(jax.tree.leaves(mask))
    base = jax.tree.map(np.asarray, nnx.state(model, BASE))
    graphdef, state = nnx.split((model, optimizer))
    batch = {
        "inputs": jnp.asarray(IDS),
        "targets": jnp.asarray(np.roll(IDS, -1, axis=1)),
        "weights": jnp.ones(IDS.shape, jnp.float32),
    }
    for _ in range(2):  # the second step moves A too (B was 0 in the first)
        state, metrics = jax.jit(lambda s, b: train_step(graphdef, s, b, task=TASKS["lm"]))(
            state, batch
        )
    assert bool(metrics["finite"])
    model, _ = nnx.merge(graphdef, state)
    jax.tree.map(np.testing.assert_array_equal, nnx.state(model, BASE), base)
    after = nnx.state(model, nnx.LoRAParam)
    for path, variable in nnx.to_flat_state(after):
        assert np.abs(np.asarray(variable[...])).max() > 0, path


def _step_temporaries(overrides, monkeypatch=None, policy=None) -> float:
    """The temporary bytes of the compiled train step of a small scanned decoder whose layers
    save their matmul outputs (``model.remat=dots_saveable``)."""
    cfg = load_config(
        None,
        [
            "model.d_model=256",
            "model.d_ff=1024",
            "model.num_decoder_layers=2",
            "model.scan_layers=true",
            "model.remat=dots_saveable",
            "model.vocab_size=64",
            *overrides,
        ],
    )
    if policy is not None:
        monkeypatch.setitem(stack.REMAT_POLICIES, "dots_saveable", policy)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: make_train_state(cfg, optax.adamw(1e-3))))
    arrays = (("inputs", jnp.int32), ("targets", jnp.int32), ("weights", jnp.float32))
    batch = {name: jax.ShapeDtypeStruct((8, 256), dtype) for name, dtype in arrays}
    step = jax.jit(lambda s, b: train_step(graphdef, s, b, task=TASKS["lm"]))
    return step.lower(state, batch).compile().memory_analysis().temp_size_in_bytes


def test_a_remat_policy_that_saves_matmuls_saves_an_adapted_projection_s_output(monkeypatch):
    """``x W + x A B`` is no matmul output: saved by name, or the backward pass keeps the
    adapter's own output to recompute the sum (measured: 1.4x the temporaries of the step)."""
    named = _step_temporaries(["lora.rank=8"])
    unnamed = _step_temporaries(["lora.rank=8"], monkeypatch, jax.checkpoint_policies.dots_saveable)
    assert named < 0.85 * unnamed, (named, unnamed)
