"""Sharding over a (data, fsdp, tensor) mesh: mesh sizes, logical axis rules and their config,
shard shapes and bytes, sharded creation, identical losses on every mesh, checkpoints restored
onto other meshes, multi-process batch feeding and activation constraints.

The 8 devices are the simulated CPU devices of conftest.py; the one-device baseline of the
training runs comes from a subprocess started with a single device.
"""

import fcntl
import inspect
import json
import math
import os
import pathlib
import re
import shutil
import subprocess
import sys

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import yaml
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from subprocess_env import subprocess_env

from flaxformer_lite.models import ModelConfig, build_model
from flaxformer_lite.nn.sharding import ACTIVATION_NAMES, constrain
from flaxformer_lite.parallel import (
    DEFAULT_RULES,
    MESH_AXES,
    DistributedConfig,
    abstract_sharded,
    array_layouts,
    batch_sharding,
    check_batch_size,
    create_sharded,
    describe_mesh,
    device_bytes,
    initialize,
    logical_spec,
    make_mesh,
    mesh_shape,
    process_batch_shard,
    put_batch,
    replicated_warnings,
    rule_pairs,
    shard_bytes,
)
from flaxformer_lite.train.checkpoint import Checkpointer
from flaxformer_lite.train.config import ConfigError, config_from_dict, load_config
from flaxformer_lite.train.loop import run
from flaxformer_lite.train.restore import from_savable, restore_target, to_savable
from flaxformer_lite.train.step import make_train_step

pytestmark = pytest.mark.fast_compile  # XLA's backend optimizations off: conftest.py

REPO = pathlib.Path(__file__).resolve().parents[1]

# A tiny GPT-2 (2 layers, d_model 64, 4 heads, d_ff 256, dropout on) with a vocabulary and
# length that divide over every mesh used below.
TINY = dict(vocab_size=64, max_length=16)
B, T = 8, 16


def tiny(seed=0, **overrides):
    """``(cfg, create)``: ``create()`` builds the model and its adamw ``nnx.Optimizer``."""
    cfg = ModelConfig.from_preset("gpt2-tiny", **{**TINY, **overrides})
    tx = optax.adamw(1e-2)  # one transformation: equal graphdefs from every call

    def create():
        model = build_model(cfg, rngs=nnx.Rngs(params=seed, dropout=seed + 1))
        return model, nnx.Optimizer(model, tx, wrt=nnx.Param)

    return cfg, create


def flat(state):
    """``{path: Variable}`` of an nnx.State."""
    return dict(nnx.to_flat_state(state))


def names_of(variable):
    return tuple(variable.get_metadata().get("out_sharding") or ())


def key_free(tree):
    """``to_savable``-style numpy copy: typed PRNG keys as their key data."""

    def leaf(x):
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        return np.asarray(x)

    return jax.tree.map(leaf, nnx.to_pure_dict(tree) if isinstance(tree, nnx.State) else tree)


def lm_batch(seed, vocab=TINY["vocab_size"]):
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, vocab, (B, T + 1)).astype(np.int32)
    return dict(inputs=ids[:, :-1], targets=ids[:, 1:], weights=np.ones((B, T), np.float32))


def relative_close(a, b, rtol=1e-5):
    return abs(a - b) <= rtol * max(abs(a), abs(b))


# --------------------------------------------------------------------------- 1. the mesh
def test_mesh_shape_resolves_minus_one_and_rejects_bad_sizes():
    assert mesh_shape(-1, 1, 1, 8) == (8, 1, 1)
    assert mesh_shape(2, -1, 2, 8) == (2, 2, 2)
    assert mesh_shape(1, 2, -1, 8) == (1, 2, 4)
    assert mesh_shape(2, 1, 4, 8) == (2, 1, 4)
    with pytest.raises(ValueError, match=r"needs 4 devices, but there are 8"):
        mesh_shape(2, 2, 1, 8)
    with pytest.raises(ValueError, match=r"needs 16 devices, but there are 8"):
        mesh_shape(2, 2, 4, 8)
    with pytest.raises(ValueError, match=r"8 devices are not divisible .* 3"):
        mesh_shape(-1, 3, 1, 8)
    with pytest.raises(ValueError, match="at most one mesh axis may be -1"):
        mesh_shape(-1, -1, 1, 8)
    for bad in (0, -2, 1.0, True):
        with pytest.raises(ValueError, match="mesh.fsdp must be a positive int or -1"):
            mesh_shape(1, bad, 1, 8)


def test_make_mesh_axes_and_devices():
    mesh = make_mesh(2, 1, 4)
    assert mesh.axis_names == MESH_AXES == ("data", "fsdp", "tensor")
    assert dict(mesh.shape) == {"data": 2, "fsdp": 1, "tensor": 4}
    assert tuple(mesh.axis_types) == (AxisType.Auto,) * 3
    assert sorted(d.id for d in mesh.devices.flat) == list(range(8))
    assert describe_mesh(mesh) == "data 2 x fsdp 1 x tensor 4 (8 cpu devices, 1 process)"
    assert dict(make_mesh().shape) == {"data": 8, "fsdp": 1, "tensor": 1}
    assert dict(make_mesh(fsdp=-1, data=2).shape) == {"data": 2, "fsdp": 4, "tensor": 1}

    one = make_mesh(devices=jax.devices()[:1])
    assert dict(one.shape) == {"data": 1, "fsdp": 1, "tensor": 1}
    assert list(one.devices.flat) == [jax.devices()[0]]
    assert tuple(one.axis_types) == (AxisType.Auto,) * 3
    two = make_mesh(1, 1, 2, devices=jax.devices()[2:4])
    assert list(two.devices.flat) == jax.devices()[2:4]
    with pytest.raises(ValueError, match="there are 1"):
        make_mesh(2, 1, 1, devices=jax.devices()[:1])


# --------------------------------------------------------------------------- 2. rules + config
def test_logical_spec_precedence_and_unmapped_names():
    rules = DEFAULT_RULES
    # The batch comes first and takes fsdp: the embed dimension of activations is replicated.
    assert logical_spec(("batch", "length", "embed"), rules) == P(("data", "fsdp"), None, None)
    assert logical_spec(ACTIVATION_NAMES, rules) == P(("data", "fsdp"), None, None)
    assert logical_spec(("embed", "mlp"), rules) == P("fsdp", "tensor")
    assert logical_spec(("vocab", "embed"), rules) == P("tensor", "fsdp")
    assert logical_spec(("heads", "head_dim", "embed"), rules) == P("tensor", None, "fsdp")
    assert logical_spec(("norm",), rules) == P(None)
    assert logical_spec((None, "no such name"), rules) == P(None, None)
    assert logical_spec(("layers", "embed"), rules) == P(None, "fsdp")  # empty rule: replicated
    # Rule order is precedence: with embed first it takes fsdp, and the batch's rule, which
    # needs fsdp too, is not applied at all.
    embed_first = {"embed": ("fsdp",), "batch": ("data", "fsdp")}
    assert logical_spec(("batch", "embed"), embed_first) == P(None, "fsdp")
    assert logical_spec(("batch", "embed"), dict(reversed(embed_first.items()))) == P(
        ("data", "fsdp"), None
    )
    assert rule_pairs({"a": (), "b": ("x",), "c": ("x", "y")}) == (
        ("a", None),
        ("b", "x"),
        ("c", ("x", "y")),
    )


def test_mesh_rules_from_yaml_and_command_line_are_laid_over_the_defaults(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "mesh": {
                    "data": 2,
                    "tensor": 4,
                    "rules": {"mlp": [], "batch": ["data"], "vocab": "tensor", "length": None},
                },
            }
        )
    )
    cfg = load_config(path)
    assert (cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor) == (2, 1, 4)
    assert cfg.mesh.rules == {**DEFAULT_RULES, "mlp": (), "batch": ("data",), "length": ()}
    # The defaults keep their order (precedence); new names come after them.
    assert list(cfg.mesh.rules) == [*DEFAULT_RULES, "length"]

    overrides = [
        "mesh.rules.mlp=none",
        "mesh.rules.batch=data,fsdp",
        "mesh.rules.heads=",
        "mesh.rules.activation_embed=tensor",
    ]
    cfg = load_config(path, overrides)
    assert cfg.mesh.rules["mlp"] == ()
    assert cfg.mesh.rules["batch"] == ("data", "fsdp")
    assert cfg.mesh.rules["heads"] == ()
    assert cfg.mesh.rules["activation_embed"] == ("tensor",)
    assert cfg.mesh.rules["kv_heads"] == ("tensor",)  # untouched default
    assert cfg.mesh.rules["length"] == ()  # from the file

    cli = load_config(None, ["mesh.rules.mlp=none", "mesh.rules.batch=data,fsdp", "mesh.fsdp=2"])
    assert cli.mesh.rules == {**DEFAULT_RULES, "mlp": ()}
    assert cli.mesh.fsdp == 2
    assert load_config(None).mesh.rules == DEFAULT_RULES


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["mesh.rules.mlp=model"], r"mesh.rules.mlp names mesh axis 'model'"),
        (["mesh.rules.batch=data,tensor,pipeline"], r"mesh.rules.batch names mesh axis 'pipeline'"),
        (["mesh.rules.batch=data,data"], r"mesh.rules.batch names a mesh axis twice"),
        (["mesh.data=0"], r"mesh.data must be a positive int or -1"),
        (["mesh.data=-1", "mesh.tensor=-1"], r"at most one mesh axis may be -1"),
    ],
)
def test_bad_mesh_config_is_a_config_error(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_unknown_mesh_axis_in_a_yaml_file_is_a_config_error(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("mesh:\n  rules:\n    heads: [model]\n")
    with pytest.raises(ConfigError, match="mesh.rules.heads names mesh axis 'model'"):
        load_config(path)


def test_config_with_mesh_and_distributed_round_trips_through_json_and_yaml(tmp_path):
    cfg = load_config(
        None,
        [
            "mesh.data=2",
            "mesh.tensor=4",
            "mesh.rules.mlp=none",
            "mesh.rules.batch=data,fsdp",
            "mesh.rules.length=tensor",
            "distributed.num_processes=2",
            "distributed.process_id=1",
            "distributed.coordinator_address=10.0.0.1:1234",
            "distributed.enabled=true",
        ],
    )
    assert cfg.distributed == DistributedConfig(
        enabled=True, coordinator_address="10.0.0.1:1234", num_processes=2, process_id=1
    )
    plain = cfg.to_dict()
    assert plain["mesh"]["rules"]["batch"] == ["data", "fsdp"]
    from_json = config_from_dict(json.loads(json.dumps(plain)))
    assert from_json == cfg
    assert list(from_json.mesh.rules) == list(cfg.mesh.rules)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(plain, sort_keys=False))
    from_yaml = load_config(path)
    assert from_yaml == cfg
    assert list(from_yaml.mesh.rules) == list(cfg.mesh.rules)


# --------------------------------------------------------------------------- 3. shards and bytes
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
    for mesh in (make_mesh(1, 1, 4, devices=jax.devices()[:4]), make_mesh(2, 1, 4)):
        _, state, shardings = abstract_sharded(create, mesh, no_vocab)
        params, placed = (
            nnx.filter_state(state[0], nnx.Param),
            nnx.filter_state(shardings[0], nnx.Param),
        )
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
    _, state, shardings = abstract_sharded(create, mesh, no_vocab)
    params, placed = (
        nnx.filter_state(state[0], nnx.Param),
        nnx.filter_state(shardings[0], nnx.Param),
    )
    assert replicated_warnings(params, placed, mesh, share=0.0) == []
    # The default rules on fsdp shard every large parameter.
    mesh = make_mesh(1, 8, 1)
    _, state, shardings = abstract_sharded(create, mesh, DEFAULT_RULES)
    params, placed = (
        nnx.filter_state(state[0], nnx.Param),
        nnx.filter_state(shardings[0], nnx.Param),
    )
    assert replicated_warnings(params, placed, mesh) == []
    layouts = array_layouts(params, placed)
    assert all(not layout.replicated for layout in layouts if "embed" in layout.names)


# --------------------------------------------------------------------------- 4. sharded creation
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


# --------------------------------------------------------------------------- 5. same losses
# The default run's gpt2-tiny with one layer (half the compile time), dropout on. The byte
# tokenizer's 260 ids divide by the tensor sizes 4 and 2 used here (not by 8: tensor=8 would
# need mesh.rules.vocab=none), and its 4 heads, d_ff 256 and d_model 64 divide over every mesh
# below. Constant learning rate: a run's losses do not depend on train.steps.
E2E = [
    "model.num_decoder_layers=1",
    "train.batch_size=8",
    "data.seq_len=32",
    "optimizer.warmup_steps=0",
    "optimizer.schedule=constant",
    "train.log_every=5",
    "train.eval_every=1000",
    "train.eval_batches=1",
    "data.eval_size=16",
]
PER_DEVICE = re.compile(
    r"^per device: parameters ([\d.]+) MiB of ([\d.]+) MiB, "
    r"optimizer state ([\d.]+) MiB of ([\d.]+) MiB$"
)


def metrics_of(run_dir):
    path = pathlib.Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def losses_of(run_dir, key="loss"):
    return {r["step"]: r[key] for r in metrics_of(run_dir) if r.get(key) is not None}


def train_in_process(run_dir, *overrides):
    messages = []
    cfg = load_config(None, [f"run_dir={run_dir}", *E2E, *overrides])
    run(cfg, progress=False, log=messages.append)
    return messages


def per_device_line(messages):
    lines = [m for m in messages if m.startswith("per device:")]
    assert len(lines) == 1, messages
    match = PER_DEVICE.match(lines[0])
    assert match, lines[0]
    return [float(x) for x in match.groups()]


def assert_same_losses(losses, reference, steps):
    assert sorted(losses) == sorted(reference) == steps, (losses, reference)
    for step in steps:
        assert relative_close(losses[step], reference[step]), (step, losses, reference)


@pytest.fixture(scope="module")
def one_device_baseline(tmp_path_factory):
    """``(process, run_dir)``: 20 steps in a separate process that sees a single CPU device,
    started before the in-process runs so that it runs while they do."""
    run_dir = tmp_path_factory.mktemp("one_device") / "run"
    env = subprocess_env(1, JAX_DEFAULT_MATMUL_PRECISION="highest")
    process = subprocess.Popen(
        [
            sys.executable,
            str(REPO / "train.py"),
            "--no-progress",
            f"run_dir={run_dir}",
            *E2E,
            "train.steps=20",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=REPO,
    )
    yield process, run_dir
    if process.poll() is None:
        process.kill()
        process.wait()


@pytest.fixture(scope="module")
def mesh_2x4_run(tmp_path_factory):
    """``(run_dir, messages)`` of 20 steps on data 2 x tensor 4, checkpointed at steps 10 and 20.

    Shared by the xdist workers of this session (a file lock; the pattern of pytest-xdist's
    docs): the losses test and the resume test both need it, and it takes a while."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    run_dir, done = root / "parallel_mesh_2x4" / "run", root / "parallel_mesh_2x4.json"
    with open(root / "parallel_mesh_2x4.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            shutil.rmtree(run_dir, ignore_errors=True)
            messages = train_in_process(
                run_dir, "train.steps=20", "checkpoint.every=10", "mesh.data=2", "mesh.tensor=4"
            )
            done.write_text(json.dumps(messages))
        messages = json.loads(done.read_text())
    return run_dir, messages


@pytest.mark.slow
def test_every_mesh_logs_the_losses_of_one_device(tmp_path, one_device_baseline, mesh_2x4_run):
    baseline, baseline_dir = one_device_baseline
    runs = {"data 2 x tensor 4": mesh_2x4_run}
    for name, overrides in {
        "data 8": ["mesh.data=8"],
        "fsdp 4 x tensor 2": ["mesh.fsdp=4", "mesh.tensor=2"],
    }.items():
        run_dir = tmp_path / name.replace(" ", "")
        runs[name] = run_dir, train_in_process(run_dir, "train.steps=20", *overrides)
    output, _ = baseline.communicate(timeout=400)
    assert baseline.returncode == 0, output
    assert "mesh: data 1 x fsdp 1 x tensor 1 (1 cpu device, 1 process)" in output, output

    one = losses_of(baseline_dir)
    one_eval = losses_of(baseline_dir, "eval_loss")
    assert set(one_eval) == {20}
    for name, (run_dir, _) in runs.items():
        assert_same_losses(losses_of(run_dir), one, [5, 10, 15, 20])
        assert relative_close(losses_of(run_dir, "eval_loss")[20], one_eval[20]), name

    # The start-up summary of each mesh.
    lines = {
        name: [m for m in messages if m.startswith("mesh: ")]
        for name, (_, messages) in runs.items()
    }
    assert lines == {
        "data 2 x tensor 4": ["mesh: data 2 x fsdp 1 x tensor 4 (8 cpu devices, 1 process)"],
        "data 8": ["mesh: data 8 x fsdp 1 x tensor 1 (8 cpu devices, 1 process)"],
        "fsdp 4 x tensor 2": ["mesh: data 1 x fsdp 4 x tensor 2 (8 cpu devices, 1 process)"],
    }
    sizes = {name: per_device_line(messages) for name, (_, messages) in runs.items()}
    params, params_total, opt, opt_total = sizes["data 8"]
    assert params == params_total > 0 and opt == opt_total > params
    for name in ("data 2 x tensor 4", "fsdp 4 x tensor 2"):
        assert sizes[name][1::2] == [params_total, opt_total], name
    assert sizes["fsdp 4 x tensor 2"][0] < params_total / 4
    assert params_total / 4 < sizes["data 2 x tensor 4"][0] < params_total / 2
    assert not any(m.startswith("warning:") for m in runs["data 8"][1])


# --------------------------------------------------------------------------- 6. restore reshards
@pytest.mark.slow
def test_a_checkpoint_restores_onto_other_meshes_bit_for_bit(tmp_path):
    # Scanned layers: the stacked parameters' leading "layers" axis is restored too.
    _, create = tiny(seed=1, num_decoder_layers=1, scan_layers=True)
    rules = DEFAULT_RULES
    source = make_mesh(2, 1, 4)
    graphdef, state, shardings = create_sharded(create, source, rules)
    step = make_train_step(graphdef, task="lm", state_shardings=shardings)
    place = batch_sharding(source, rules)
    with jax.set_mesh(source), nnx.logical_axis_rules(rule_pairs(rules)):
        for i in range(3):
            state, metrics = step(state, put_batch(lm_batch(i), place, B))
            assert bool(metrics["finite"])
    saved = key_free(to_savable(state))
    with Checkpointer(tmp_path / "checkpoints", keep=2) as checkpointer:
        assert checkpointer.save(3, to_savable(state), data_state={}, config={}, force=True)
        checkpointer.wait()
    next_batch = lm_batch(3)
    with jax.set_mesh(source), nnx.logical_axis_rules(rule_pairs(rules)):
        _, metrics = step(state, put_batch(next_batch, place, B))
    reference = float(metrics["loss"])

    targets = {
        "data 4 x tensor 2": make_mesh(4, 1, 2),
        "data 8": make_mesh(8, 1, 1),
        "one device": make_mesh(1, 1, 1, devices=jax.devices()[:1]),
    }
    with Checkpointer(tmp_path / "checkpoints", keep=2) as checkpointer:
        for name, mesh in targets.items():
            target_graphdef, abstract, target_shardings = abstract_sharded(create, mesh, rules)
            restored = checkpointer.restore(restore_target(abstract))
            assert restored.step == 3
            restored_state = from_savable(restored.state, abstract)
            placed = flat(target_shardings)
            for path, variable in flat(restored_state).items():
                array = variable.get_value()
                assert isinstance(array, jax.Array), (name, path)
                assert array.sharding == placed[path].get_value(), (name, path)
                assert {d for d in array.devices()} == set(mesh.devices.flat), (name, path)
            jax.tree.map(np.testing.assert_array_equal, key_free(to_savable(restored_state)), saved)
            target_step = make_train_step(
                target_graphdef, task="lm", state_shardings=target_shardings
            )
            with jax.set_mesh(mesh), nnx.logical_axis_rules(rule_pairs(rules)):
                batch = put_batch(next_batch, batch_sharding(mesh, rules), B)
                _, metrics = target_step(restored_state, batch)
            assert relative_close(float(metrics["loss"]), reference), (name, reference)


@pytest.mark.slow
def test_a_run_resumes_on_another_mesh_as_if_uninterrupted(tmp_path, mesh_2x4_run):
    reference_dir, _ = mesh_2x4_run
    # The 20-step run on data 2 x tensor 4 as it was after step 10: its checkpoint of step 10
    # is the one a 10-step run ends with (as if it had been stopped there; the metrics of later
    # steps are dropped on resume). That run goes on uninterrupted: the reference.
    run_dir = tmp_path / "run"
    shutil.copytree(reference_dir, run_dir)
    shutil.rmtree(run_dir / "checkpoints" / "20")
    with Checkpointer(run_dir / "checkpoints", keep=3) as checkpointer:
        assert checkpointer.all_steps() == [10]
    # mesh.* are runtime keys: no --force needed.
    messages = train_in_process(
        run_dir, "train.steps=15", "checkpoint.every=10", "mesh.data=4", "mesh.tensor=2"
    )
    assert (
        "resuming on mesh data 4 x fsdp 1 x tensor 2; the checkpoint was written on "
        "data 2 x fsdp 1 x tensor 4: arrays are resharded as they are restored"
    ) in messages
    assert any(m.startswith("resumed from step 10 ") for m in messages), messages
    assert "mesh: data 4 x fsdp 1 x tensor 2 (8 cpu devices, 1 process)" in messages
    # With a constant learning rate the reference's first 15 steps are those of a 15-step run.
    reference = {k: v for k, v in losses_of(reference_dir).items() if k <= 15}
    assert_same_losses(losses_of(run_dir), reference, [5, 10, 15])
    with Checkpointer(run_dir / "checkpoints", keep=3) as checkpointer:
        assert checkpointer.all_steps() == [10, 15]
    assert load_config(run_dir / "config.yaml").mesh.data == 4


# --------------------------------------------------------------------------- 7. several processes
def test_process_batch_shard_and_put_batch_on_one_process():
    for mesh in (make_mesh(2, 2, 2), make_mesh(1, 1, 1, devices=jax.devices()[:1])):
        sharding = batch_sharding(mesh, DEFAULT_RULES)
        assert process_batch_shard(sharding, 8) == (0, 1)
        batch = {
            "inputs": np.arange(8 * 5, dtype=np.int32).reshape(8, 5),
            "weights": np.linspace(0, 1, 8 * 5, dtype=np.float32).reshape(8, 5),
        }
        placed = put_batch(batch, sharding, 8)
        assert placed.keys() == batch.keys()
        for key, array in placed.items():
            assert isinstance(array, jax.Array)
            assert array.shape == (8, 5) and array.dtype == batch[key].dtype
            assert array.sharding == sharding
            np.testing.assert_array_equal(np.asarray(array), batch[key])
            rows = 8 // (mesh.shape["data"] * mesh.shape["fsdp"])
            for shard in array.addressable_shards:
                assert shard.data.shape == (rows, 5)
                np.testing.assert_array_equal(np.asarray(shard.data), batch[key][shard.index])


def test_initialize_connects_only_when_asked(monkeypatch):
    calls = []
    signature = inspect.signature(jax.distributed.initialize)

    def connect(**kwargs):
        signature.bind(**kwargs)  # arguments the real function takes
        calls.append(kwargs)

    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(jax.distributed, "initialize", connect)
    assert initialize(DistributedConfig(), environ={}) is False
    assert initialize(DistributedConfig(), environ={"JAX_NUM_PROCESSES": "1"}) is False
    assert (
        initialize(DistributedConfig(enabled=False), environ={"JAX_COORDINATOR_ADDRESS": "host:1"})
        is False
    )
    assert calls == []
    # The environment a launcher sets, and the config taking precedence over it.
    environ = {
        "JAX_COORDINATOR_ADDRESS": "host:1234",
        "JAX_NUM_PROCESSES": "4",
        "JAX_PROCESS_ID": "3",
    }
    assert initialize(DistributedConfig(heartbeat_timeout=7), environ=environ) is True
    assert (
        initialize(DistributedConfig(process_id=2, initialization_timeout=9), environ=environ)
        is True
    )
    assert initialize(DistributedConfig(enabled=True), environ={}) is True
    assert [(c["coordinator_address"], c["num_processes"], c["process_id"]) for c in calls] == [
        ("host:1234", 4, 3),
        ("host:1234", 4, 2),
        (None, None, None),
    ]
    assert calls[0]["heartbeat_timeout_seconds"] == 7
    assert calls[1]["initialization_timeout"] == 9


def test_initialize_rejects_a_non_integer_environment_before_connecting(monkeypatch):
    def connect(**kwargs):
        raise AssertionError("jax.distributed.initialize must not be called")

    monkeypatch.setattr(jax.distributed, "initialize", connect)
    with pytest.raises(
        ValueError, match="environment variable JAX_NUM_PROCESSES must be an integer, got 'abc'"
    ):
        initialize(DistributedConfig(), environ={"JAX_NUM_PROCESSES": "abc"})
    with pytest.raises(ValueError, match="JAX_PROCESS_ID"):
        initialize(
            DistributedConfig(),
            environ={"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_PROCESS_ID": "first"},
        )
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match="heartbeat_timeout must be a positive"):
            DistributedConfig(heartbeat_timeout=bad)


# --------------------------------------------------------------------------- 8. constrain
def count_constraints(jaxpr) -> int:
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)  # a ClosedJaxpr's Jaxpr
    count = 0
    for eqn in jaxpr.eqns:
        count += eqn.primitive.name == "sharding_constraint"
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            count += count_constraints(sub)
    return count


def test_constrain_is_a_no_op_without_a_mesh_and_rules():
    x = np.ones((8, 4, 16), np.float32)
    assert count_constraints(jax.make_jaxpr(lambda x: constrain(x, ACTIVATION_NAMES))(x)) == 0
    assert constrain(x, ACTIVATION_NAMES) is x
    mesh = make_mesh(2, 4, 1)
    with jax.set_mesh(mesh):  # a mesh without rules
        assert count_constraints(jax.make_jaxpr(lambda x: constrain(x, ACTIVATION_NAMES))(x)) == 0
    with nnx.logical_axis_rules(rule_pairs(DEFAULT_RULES)):  # rules without a mesh
        assert count_constraints(jax.make_jaxpr(lambda x: constrain(x, ACTIVATION_NAMES))(x)) == 0


@pytest.mark.parametrize(
    "mesh_sizes, rules, spec",
    [
        ((2, 4, 1), DEFAULT_RULES, P(("data", "fsdp"), None, None)),
        (
            (2, 1, 4),
            {**DEFAULT_RULES, "activation_embed": ("tensor",)},
            P(("data", "fsdp"), None, "tensor"),
        ),
        ((1, 1, 8), {**DEFAULT_RULES, "length": ("tensor",), "batch": ()}, P(None, "tensor", None)),
    ],
)
def test_constrain_applies_the_rules_inside_a_mesh(mesh_sizes, rules, spec):
    mesh = make_mesh(*mesh_sizes)
    x = jax.device_put(
        np.arange(8 * 8 * 16, dtype=np.float32).reshape(8, 8, 16), NamedSharding(mesh, P())
    )
    names = ("batch", "length", "activation_embed")
    with jax.set_mesh(mesh), nnx.logical_axis_rules(rule_pairs(rules)):
        out = jax.jit(lambda x: constrain(x * 2.0, names))(x)
    assert logical_spec(names, rules) == spec
    assert out.sharding.is_equivalent_to(NamedSharding(mesh, spec), 3), out.sharding
    assert not out.sharding.is_fully_replicated
    np.testing.assert_array_equal(np.asarray(out), np.asarray(x) * 2.0)


def test_the_layer_stack_constrains_its_activations_under_a_mesh():
    cfg, _ = tiny()
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: build_model(cfg, rngs=nnx.Rngs(0))))
    ids = jax.ShapeDtypeStruct((B, T), jnp.int32)

    def forward(state, ids):
        return nnx.merge(graphdef, state)(ids)

    assert count_constraints(jax.make_jaxpr(forward)(abstract, ids)) == 0
    with jax.set_mesh(make_mesh(2, 4, 1)), nnx.logical_axis_rules(rule_pairs(DEFAULT_RULES)):
        constrained = count_constraints(jax.make_jaxpr(forward)(abstract, ids))
    assert constrained >= 2 * cfg.num_decoder_layers  # before and after every layer
