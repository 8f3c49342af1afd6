"""Sharded parameters over a (data, fsdp, tensor) mesh: shard shapes and bytes, the optimizer's
moments laid out as their parameters, indivisible dimensions, replication warnings, and sharded
creation equal to an unsharded one.

The 8 devices are the simulated CPU devices of conftest.py.
"""

import math

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from parallel_helpers import TINY, flat, key_free, tiny

from flaxformer_lite.models import ModelConfig, build_model
from flaxformer_lite.parallel import (
    DEFAULT_RULES,
    abstract_sharded,
    array_layouts,
    check_batch_size,
    create_sharded,
    device_bytes,
    make_mesh,
    replicated_warnings,
    shard_bytes,
)

pytestmark = pytest.mark.fast_compile  # XLA's backend optimizations off: conftest.py


def names_of(variable):
    return tuple(variable.get_metadata().get("out_sharding") or ())


# --------------------------------------------------------------------------- shards and bytes
def moment_pairs(state):
    """``(param path, moment path)`` of every adamw mu/nu entry."""
    everything = flat(state)
    pairs = []
    for path in everything:
        if path[0] == 1 and len(path) > 4 and path[1] == "opt_state" and path[3] in ("mu", "nu"):
            param_path = (0, *path[4:])
            assert param_path in everything, path
            pairs.append((param_path, path))
    return pairs


def check_moments_follow_params(state, shardings):
    values, placed = flat(state), flat(shardings)
    pairs = moment_pairs(state)
    assert len(pairs) == 2 * len(flat(nnx.filter_state(state[0], nnx.Param)))
    for param_path, moment_path in pairs:
        param, moment = values[param_path].get_value(), values[moment_path].get_value()
        assert moment.shape == param.shape
        assert moment.sharding == param.sharding, moment_path
        assert placed[moment_path].get_value() == placed[param_path].get_value(), moment_path


def test_fsdp_8_stores_an_eighth_of_every_embed_parameter_per_device():
    _, create = tiny()
    mesh = make_mesh(1, 8, 1)
    _, state, shardings = create_sharded(create, mesh, DEFAULT_RULES)
    params = nnx.filter_state(state[0], nnx.Param)
    param_shardings = nnx.filter_state(shardings[0], nnx.Param)
    placed = flat(param_shardings)
    total = expected = device0 = 0
    sharded = 0
    for path, variable in flat(params).items():
        array, names = variable.get_value(), names_of(variable)
        assert array.sharding == placed[path].get_value(), path
        # Only "embed" maps to fsdp (the other mapped names go to the tensor axis of size 1).
        shard_shape = tuple(
            s // 8 if n == "embed" else s for s, n in zip(array.shape, names, strict=True)
        )
        if "embed" in names:
            sharded += 1
            assert array.shape != shard_shape
        assert len(array.addressable_shards) == 8
        for shard in array.addressable_shards:
            assert shard.data.shape == shard_shape, path
        if "embed" in names:  # the 8 devices hold 8 different slices of it
            starts = {shard.index[names.index("embed")].start for shard in array.addressable_shards}
            assert len(starts) == 8
        nbytes = math.prod(shard_shape) * 4
        assert shard_bytes(array.shape, array.dtype, array.sharding) == nbytes
        total += array.size * 4
        expected += nbytes
        device0 += next(
            s.data.nbytes for s in array.addressable_shards if s.device == mesh.devices.flat[0]
        )
    assert sharded >= 12  # token/position tables, and every layer's kernels and out biases
    replicated = sum(
        v.get_value().size * 4 for v in flat(params).values() if "embed" not in names_of(v)
    )
    assert expected == (total - replicated) // 8 + replicated
    assert device_bytes(params, param_shardings) == expected == device0
    assert device_bytes(params, param_shardings) < total / 4
    # The optimizer's moments are laid out as their parameters.
    check_moments_follow_params(state, shardings)
    moments = 2 * expected  # mu and nu; the step counts are scalars
    assert moments <= device_bytes(state[1], shardings[1]) <= moments + 64


def test_tensor_4_splits_heads_mlp_and_vocab_by_4():
    _, create = tiny()
    mesh = make_mesh(2, 1, 4)
    _, state, shardings = create_sharded(create, mesh, DEFAULT_RULES)
    params = nnx.filter_state(state[0], nnx.Param)
    split = set()
    expected = 0
    for path, variable in flat(params).items():
        array, names = variable.get_value(), names_of(variable)
        shard_shape = tuple(
            s // 4 if n in ("heads", "mlp", "vocab") else s
            for s, n in zip(array.shape, names, strict=True)
        )
        split.update(n for n in names if n in ("heads", "mlp", "vocab"))
        for shard in array.addressable_shards:
            assert shard.data.shape == shard_shape, path
        distinct = {tuple((i.start, i.stop) for i in s.index) for s in array.addressable_shards}
        assert len(distinct) == (4 if shard_shape != array.shape else 1), path
        expected += math.prod(shard_shape) * 4
    assert split == {"heads", "mlp", "vocab"}
    assert device_bytes(params, nnx.filter_state(shardings[0], nnx.Param)) == expected
    check_moments_follow_params(state, shardings)


@pytest.mark.parametrize(
    "preset, overrides, mesh, pattern",
    [
        (
            "gpt2-tiny",
            {},
            (1, 1, 8),
            r"dimension 'heads' of size 4 \(model.num_heads = 4\) is not "
            r"divisible by mesh axes tensor of size 8.*mesh.rules.heads",
        ),
        ("llama-tiny", {}, (2, 1, 4), r"'kv_heads' of size 2 \(model.num_kv_heads = 2\)"),
        (
            "gpt2-tiny",
            dict(num_heads=8, vocab_size=260),
            (1, 1, 8),
            r"embed.tokens.embedding: dimension 'vocab' of size 260 \(model.vocab_size = 260\)",
        ),
        (
            "gpt2-tiny",
            dict(d_model=60, num_heads=4),
            (1, 8, 1),
            r"'embed' of size 60 \(model.d_model = 60\) "
            r"is not divisible by mesh axes fsdp of size 8",
        ),
    ],
)
def test_indivisible_dimension_names_parameter_axis_and_config_field(
    preset, overrides, mesh, pattern
):
    cfg = ModelConfig.from_preset(preset, **{**TINY, **overrides})

    def create():
        model = build_model(cfg, rngs=nnx.Rngs(0))
        return model, nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)

    with pytest.raises(ValueError, match=r"^parameter .*" + pattern):
        abstract_sharded(create, make_mesh(*mesh), DEFAULT_RULES)
    with pytest.raises(ValueError, match=pattern):
        create_sharded(create, make_mesh(*mesh), DEFAULT_RULES)


def test_check_batch_size():
    mesh = make_mesh(2, 4, 1)
    check_batch_size(8, mesh, DEFAULT_RULES)
    check_batch_size(16, mesh, DEFAULT_RULES, microbatches=2)
    with pytest.raises(
        ValueError,
        match=r"train.batch_size 12 is not divisible by the 8 batch "
        r"shards \(mesh axes dataxfsdp, rule mesh.rules.batch\)",
    ):
        check_batch_size(12, mesh, DEFAULT_RULES)
    with pytest.raises(ValueError, match=r"size 8 .* 8 batch shards .*train.grad_accum_steps 2"):
        check_batch_size(8, mesh, DEFAULT_RULES, microbatches=2)
    only_data = {**DEFAULT_RULES, "batch": ("data",)}
    check_batch_size(6, mesh, only_data)
    with pytest.raises(ValueError, match="the 2 batch shards"):
        check_batch_size(3, mesh, only_data)
    check_batch_size(3, make_mesh(1, 1, 8), DEFAULT_RULES)  # batch replicated over tensor


def test_replicated_warnings():
    _, create = tiny()
    no_vocab = {**DEFAULT_RULES, "vocab": (), "embed": ()}

    def parameters(mesh, rules):
        """The abstract parameters on ``mesh`` and their shardings."""
        _, state, shardings = abstract_sharded(create, mesh, rules)
        return nnx.filter_state(state[0], nnx.Param), nnx.filter_state(shardings[0], nnx.Param)

    for mesh in (make_mesh(1, 1, 4, devices=jax.devices()[:4]), make_mesh(2, 1, 4)):
        params, placed = parameters(mesh, no_vocab)
        warnings = replicated_warnings(params, placed, mesh)
        flagged = {w.split()[1] for w in warnings}
        assert "embed.tokens.embedding" in flagged, warnings
        assert all("replicated on every device" in w for w in warnings)
        assert not any("norm" in path for path in flagged)  # below 1% of the parameter bytes
        assert not any("qkv" in path or "mlp" in path for path in flagged)  # split by tensor
        # Nothing is left over at share 1: no parameter is all the bytes.
        assert replicated_warnings(params, placed, mesh, share=1.0) == []
    # Pure data parallelism replicates by design.
    mesh = make_mesh(8, 1, 1)
    assert replicated_warnings(*parameters(mesh, no_vocab), mesh, share=0.0) == []
    # The default rules on fsdp shard every large parameter.
    mesh = make_mesh(1, 8, 1)
    params, placed = parameters(mesh, DEFAULT_RULES)
    assert replicated_warnings(params, placed, mesh) == []
    layouts = array_layouts(params, placed)
    assert all(not layout.replicated for layout in layouts if "embed" in layout.names)


# --------------------------------------------------------------------------- sharded creation
def test_create_sharded_equals_an_unsharded_eager_init_and_abstract_sharded_allocates_nothing():
    _, create = tiny(seed=3)
    mesh = make_mesh(2, 2, 2)
    graphdef, state, shardings = create_sharded(create, mesh, DEFAULT_RULES)
    placed = flat(shardings)
    for path, variable in flat(state).items():
        assert isinstance(variable.get_value(), jax.Array)
        assert variable.get_value().sharding == placed[path].get_value(), path
    eager_graphdef, eager = nnx.split(create())
    assert eager_graphdef == graphdef
    sharded_values, eager_values = key_free(state), key_free(eager)
    assert jax.tree.structure(sharded_values) == jax.tree.structure(eager_values)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-6),
        sharded_values,
        eager_values,
    )
    # Not trivially equal: the layers' kernels differ from each other.
    layers = sharded_values[0]["decoder"]["layers"]["layers"]
    assert not np.allclose(layers[0]["mlp"]["wi"]["kernel"], layers[1]["mlp"]["wi"]["kernel"])

    before = len(jax.live_arrays())
    abstract_graphdef, abstract, abstract_shardings = abstract_sharded(create, mesh, DEFAULT_RULES)
    assert len(jax.live_arrays()) <= before
    assert abstract_graphdef == graphdef
    assert flat(abstract_shardings).keys() == placed.keys()
    for path, variable in flat(abstract).items():
        value, real = variable.get_value(), flat(state)[path].get_value()
        assert isinstance(value, jax.ShapeDtypeStruct) and not isinstance(value, jax.Array)
        assert (value.shape, value.dtype) == (real.shape, real.dtype), path
        assert value.sharding == real.sharding == flat(abstract_shardings)[path].get_value()
