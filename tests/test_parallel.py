"""Sharding over a (data, fsdp, tensor) mesh: mesh sizes, logical axis rules and their config,
multi-process batch feeding and activation constraints. Shard shapes and sharded creation are in
test_parallel_shards.py, training on several meshes in test_parallel_training.py.

The 8 devices are the simulated CPU devices of conftest.py.
"""

import inspect
import json
import pathlib
import subprocess
import sys

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest
import yaml
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from parallel_helpers import B, T, tiny
from subprocess_env import subprocess_env

from flaxformer_lite.models import ModelConfig, build_model
from flaxformer_lite.nn.sharding import ACTIVATION_NAMES, constrain
from flaxformer_lite.parallel import (
    DEFAULT_RULES,
    MESH_AXES,
    DistributedConfig,
    batch_sharding,
    describe_mesh,
    initialize,
    logical_spec,
    make_mesh,
    mesh_shape,
    mesh_sizes,
    process_batch_shard,
    put_batch,
    rule_pairs,
)
from flaxformer_lite.parallel.config import LOGICAL_NAMES
from flaxformer_lite.parallel.rules import variable_names
from flaxformer_lite.train.config import ConfigError, config_from_dict, load_config

pytestmark = pytest.mark.fast_compile  # XLA's backend optimizations off: conftest.py


# --------------------------------------------------------------------------- the mesh
def test_mesh_shape_resolves_minus_one_and_rejects_bad_sizes():
    # (data, fsdp, context, tensor)
    assert mesh_shape(-1, 1, 1, 8) == (8, 1, 1, 1)
    assert mesh_shape(2, -1, 2, 8) == (2, 2, 1, 2)
    assert mesh_shape(1, 2, -1, 8) == (1, 2, 1, 4)
    assert mesh_shape(2, 1, 4, 8) == (2, 1, 1, 4)
    assert mesh_shape(2, 1, 1, 8, context=-1) == (2, 1, 4, 1)
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
    assert mesh.axis_names == MESH_AXES == ("data", "fsdp", "context", "tensor")
    assert dict(mesh.shape) == {"data": 2, "fsdp": 1, "context": 1, "tensor": 4}
    assert tuple(mesh.axis_types) == (AxisType.Auto,) * 4
    assert sorted(d.id for d in mesh.devices.flat) == list(range(8))
    assert describe_mesh(mesh) == "data 2 x fsdp 1 x tensor 4 (8 cpu devices, 1 process)"
    assert dict(make_mesh().shape) == {"data": 8, "fsdp": 1, "context": 1, "tensor": 1}
    assert dict(make_mesh(fsdp=-1, data=2).shape) == {
        "data": 2,
        "fsdp": 4,
        "context": 1,
        "tensor": 1,
    }
    split = make_mesh(2, 1, 1, context=4)
    assert (
        describe_mesh(split) == "data 2 x fsdp 1 x context 4 x tensor 1 (8 cpu devices, 1 process)"
    )

    one = make_mesh(devices=jax.devices()[:1])
    assert dict(one.shape) == {"data": 1, "fsdp": 1, "context": 1, "tensor": 1}
    assert mesh_sizes(one) == {"data": 1, "fsdp": 1, "tensor": 1}
    assert mesh_sizes(split) == {"data": 2, "fsdp": 1, "context": 4, "tensor": 1}
    assert list(one.devices.flat) == [jax.devices()[0]]
    assert tuple(one.axis_types) == (AxisType.Auto,) * 4
    two = make_mesh(1, 1, 2, devices=jax.devices()[2:4])
    assert list(two.devices.flat) == jax.devices()[2:4]
    with pytest.raises(ValueError, match="there are 1"):
        make_mesh(2, 1, 1, devices=jax.devices()[:1])


# --------------------------------------------------------------------------- rules + config
def test_logical_spec_precedence_and_unmapped_names():
    rules = DEFAULT_RULES
    # The batch comes first and takes fsdp: the embed dimension of activations is replicated.
    assert logical_spec(("batch", "length", "embed"), rules) == P(("data", "fsdp"), None, None)
    assert logical_spec(ACTIVATION_NAMES, rules) == P(("data", "fsdp"), "context", None)
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
        (["mesh.rules.mpl=none"], r"mesh.rules.mpl: no array .* 'mpl' \(did you mean 'mlp'\?\)"),
        (["mesh.data=0"], r"mesh.data must be a positive int or -1"),
        (["mesh.data=-1", "mesh.tensor=-1"], r"at most one mesh axis may be -1"),
    ],
)
def test_bad_mesh_config_is_a_config_error(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_logical_names_are_every_name_the_models_use():
    """:data:`LOGICAL_NAMES`, which a rule must name, is what the parameters of every kind of
    model and the activations are named: no name missing, none left over."""
    variants = [
        ("transformer-tiny", dict(positions="relative", scan_layers=True)),
        ("transformer-tiny", dict(mixer="aft_full")),
        ("gpt2-tiny", dict(input_dim=3, output_dim=2, tie_embeddings=False)),
        ("gpt2-tiny", dict(fused_qkv=True)),
        ("llama-tiny", dict(fused_qkv=True)),  # grouped query heads: qkv_heads
        ("bert-tiny", dict(num_classes=3)),
    ]
    used = set(ACTIVATION_NAMES)
    for preset, overrides in variants:
        cfg = ModelConfig.from_preset(preset, **overrides)
        state = nnx.state(nnx.eval_shape(lambda cfg=cfg: build_model(cfg, rngs=nnx.Rngs(0))))
        used |= {n for _, v in nnx.to_flat_state(state) for n in variable_names(v) if n}
    assert used == set(LOGICAL_NAMES)


def test_train_py_refuses_a_rule_for_an_unknown_name(tmp_path):
    run_dir = tmp_path / "run"
    child = subprocess.run(
        [sys.executable, "train.py", "mesh.rules.mpl=none", f"run_dir={run_dir}"],
        cwd=pathlib.Path(__file__).resolve().parents[1],
        env=subprocess_env(1),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert child.returncode == 2, child.stderr[-3000:]
    last = child.stderr.strip().splitlines()[-1]
    assert last.startswith("error: mesh.rules.mpl: ") and "mlp, layers" in last, last
    assert not run_dir.exists()  # nothing saved


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


# --------------------------------------------------------------------------- several processes
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


# --------------------------------------------------------------------------- constrain
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
