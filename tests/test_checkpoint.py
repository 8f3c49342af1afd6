"""Checkpointer: exact round trips onto other meshes, retention, kill -9 mid-save, corruption."""

import logging
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import textwrap
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from flaxformer_lite.train.checkpoint import Checkpointer, CheckpointError, CheckpointShapeError

pytestmark = pytest.mark.fast_compile  # XLA's backend optimizations off: conftest.py

LOGGER = "flaxformer_lite.train.checkpoint"
REPO = pathlib.Path(__file__).resolve().parents[1]
CONFIG = {"model": {"d_model": 16, "dropout": 0.1}, "seed": 0, "run_dir": "runs/x", "clip": None}


def make_state(step: int, mesh=None):
    """A small train state: sharded float32 kernel, bf16 bias, int counters, PRNG key data."""
    kernel = jax.random.normal(jax.random.key(step), (8, 16), jnp.float32)
    if mesh is not None:
        kernel = jax.device_put(kernel, NamedSharding(mesh, P("data", "model")))
    return {
        "params": {"kernel": kernel, "bias": jnp.linspace(-1, 1, 16, dtype=jnp.bfloat16) * step},
        "opt": {"count": jnp.asarray(step, jnp.int32), "mu": kernel * 0.5},
        "rng": jax.random.key_data(jax.random.fold_in(jax.random.key(7), step)),
        "step": jnp.asarray(step, jnp.int32),
    }


def onto(state, sharding_of):
    """The abstract target of ``state`` with the sharding ``sharding_of(leaf)`` for each leaf."""
    shapes = jax.eval_shape(lambda: state)
    return jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding_of(s)), shapes
    )


def single_device(state, device=None):
    return onto(state, lambda _: SingleDeviceSharding(device or jax.devices()[0]))


def assert_trees_equal(actual, expected):
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        assert a.dtype == e.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(e))
        assert np.asarray(a).tobytes() == np.asarray(e).tobytes()  # bit for bit


def save_steps(ckpt, steps, losses=None):
    for i, step in enumerate(steps):
        metrics = None if losses is None else {"eval_loss": losses[i]}
        assert ckpt.save(
            step, make_state(step), data_state={"pos": step}, config=CONFIG, metrics=metrics
        )
    ckpt.wait()


def test_round_trip_reshards_bit_identically(tmp_path):
    mesh_24 = jax.make_mesh((2, 4), ("data", "model"), devices=jax.devices()[:8])
    state = make_state(3, mesh_24)
    data_state = {"next_index": 12345, "worker": [0, 1], "name": "shard-00001"}
    with Checkpointer(tmp_path, keep=2) as ckpt:
        assert ckpt.save(3, state, data_state=data_state, config=CONFIG)
        ckpt.wait()
        assert ckpt.latest_step() == 3

    ckpt = Checkpointer(tmp_path, keep=2)  # a fresh process would see the same
    mesh_42 = jax.make_mesh((4, 2), ("data", "model"), devices=jax.devices()[:8])
    kernel_spec = NamedSharding(mesh_42, P("model", "data"))
    replicated = NamedSharding(mesh_42, P())

    def sharding_42(leaf):
        return kernel_spec if leaf.shape == (8, 16) else replicated

    for target in (onto(state, sharding_42), single_device(state, jax.devices()[5])):
        restored = ckpt.restore(target)
        assert (restored.step, restored.data_state, restored.config) == (3, data_state, CONFIG)
        assert_trees_equal(restored.state, state)
        for got, want in zip(jax.tree.leaves(restored.state), jax.tree.leaves(target), strict=True):
            assert got.sharding == want.sharding
    assert ckpt.restore_config() == CONFIG
    key = jax.random.wrap_key_data(restored.state["rng"])
    np.testing.assert_array_equal(
        jax.random.bits(key, (4,)), jax.random.bits(jax.random.fold_in(jax.random.key(7), 3), (4,))
    )
    ckpt.close()


def test_restore_rejects_targets_without_concrete_shardings(tmp_path):
    with Checkpointer(tmp_path, keep=1) as ckpt:
        save_steps(ckpt, [1])
        no_sharding = jax.tree.map(
            lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype), jax.eval_shape(make_state, 1)
        )
        with pytest.raises(ValueError, match=r"abstract_state\['opt'\]\['count'\] has no sharding"):
            ckpt.restore(no_sharding)
        mesh = jax.make_mesh((2, 4), ("data", "model"), devices=jax.devices()[:8])
        target = single_device(make_state(1))
        # jax.eval_shape keeps a sharded array's NamedSharding, but over an AbstractMesh.
        target["params"]["kernel"] = jax.eval_shape(lambda: make_state(1, mesh))["params"]["kernel"]
        with pytest.raises(ValueError, match=r"\['params'\]\['kernel'\] is sharded over an Abstr"):
            ckpt.restore(target)


def test_typed_prng_keys_and_array_targets(tmp_path):
    state = {"key": jax.random.key(3), "w": jnp.ones(3, jnp.bfloat16)}
    with Checkpointer(tmp_path, keep=1) as ckpt:
        ckpt.save(1, state, data_state={}, config=CONFIG)
        ckpt.wait()
        restored = ckpt.restore(state).state  # concrete arrays as the target: their shardings
    assert jax.dtypes.issubdtype(restored["key"].dtype, jax.dtypes.prng_key)
    np.testing.assert_array_equal(
        jax.random.key_data(restored["key"]), jax.random.key_data(state["key"])
    )
    assert_trees_equal(restored["w"], state["w"])


def test_async_save_snapshots_the_state(tmp_path):
    """Arrays may be donated or deleted as soon as save() returns."""
    state, expected = make_state(1), jax.tree.map(np.asarray, make_state(1))
    with Checkpointer(tmp_path, keep=1, async_save=True) as ckpt:
        ckpt.save(1, state, data_state={}, config=CONFIG)
        jax.tree.map(lambda a: a.delete(), state)
        ckpt.wait()
        assert_trees_equal(ckpt.restore(single_device(expected)).state, expected)


def test_retention_keeps_latest_and_best(tmp_path):
    losses = [3.0, 1.0, 2.5, 2.6, 2.7, 2.8]  # step 2 is best
    with Checkpointer(tmp_path, keep=2) as ckpt:
        save_steps(ckpt, range(1, 7), losses)
        assert ckpt.all_steps() == [2, 5, 6]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["2", "5", "6"]
    # The metrics are on disk: a restarted run still knows which one is best.
    with Checkpointer(tmp_path, keep=2) as ckpt:
        save_steps(ckpt, [7], [2.9])
        save_steps(ckpt, [8])  # no eval this time
        assert ckpt.all_steps() == [2, 7, 8]
        save_steps(ckpt, [9], [0.5])  # a new best
        save_steps(ckpt, [10, 11])
        assert ckpt.all_steps() == [9, 10, 11]


def test_retention_without_metrics_keeps_latest(tmp_path):
    with Checkpointer(tmp_path, keep=3, async_save=False) as ckpt:
        save_steps(ckpt, range(1, 6))
        assert ckpt.all_steps() == [3, 4, 5]


def test_every_and_force(tmp_path):
    with Checkpointer(tmp_path, keep=5, every=3) as ckpt:
        saved = [
            ckpt.save(step, make_state(step), data_state={}, config=CONFIG) for step in range(1, 8)
        ]
        assert saved == [False, False, True, False, False, True, False]
        assert ckpt.save(7, make_state(7), data_state={}, config=CONFIG, force=True)
        # e.g. SIGTERM right after a regular save: the step is not written twice.
        assert not ckpt.save(7, make_state(7), data_state={}, config=CONFIG, force=True)
        ckpt.wait()
        assert ckpt.all_steps() == [3, 6, 7]


def test_wait_and_close_finish_the_save(tmp_path):
    ckpt = Checkpointer(tmp_path, keep=2)
    ckpt.save(1, make_state(1), data_state={"pos": 1}, config=CONFIG)
    ckpt.close()
    assert [p.name for p in tmp_path.iterdir()] == ["1"]  # committed, no tmp directory left
    ckpt = Checkpointer(tmp_path, keep=2)
    ckpt.save(2, make_state(2), data_state={"pos": 2}, config=CONFIG)
    assert ckpt.latest_step() in (1, 2)  # 2 only once committed
    ckpt.wait()
    assert ckpt.latest_step() == 2
    assert ckpt.restore(single_device(make_state(2))).data_state == {"pos": 2}
    ckpt.close()


def test_empty_directory_and_missing_step_raise_clear_errors(tmp_path):
    directory = tmp_path / "ckpts"
    with Checkpointer(directory, keep=1) as ckpt:
        assert ckpt.latest_step() is None
        with pytest.raises(CheckpointError, match=f"no finished checkpoint in {directory}"):
            ckpt.restore(single_device(make_state(1)))
        with pytest.raises(CheckpointError, match=str(directory)):
            ckpt.restore_config()
        save_steps(ckpt, [1])
        with pytest.raises(CheckpointError, match=r"no checkpoint for step 5 .* steps \[1\]"):
            ckpt.restore(single_device(make_state(1)), step=5)
    with pytest.raises(ValueError, match="keep must be a positive int"):
        Checkpointer(directory, keep=0)
    with Checkpointer(directory, keep=1) as ckpt:
        with pytest.raises(TypeError, match="data_state must be JSON-serializable"):
            ckpt.save(2, make_state(2), data_state={"state": b"bytes"}, config=CONFIG)
        with pytest.raises(TypeError, match="config does not survive JSON unchanged"):
            ckpt.save(2, make_state(2), data_state={}, config={"shape": (1, 2)})
        assert ckpt.all_steps() == [1]


def _truncate_array_files(step_dir: pathlib.Path) -> None:
    """Cuts the TensorStore (OCDBT) data files of a checkpoint's arrays in half."""
    data_files = [p for p in (step_dir / "state").rglob("d/*") if p.is_file()]
    assert data_files
    for path in data_files:
        os.truncate(path, path.stat().st_size // 2)


def test_corrupted_newest_falls_back_to_previous(tmp_path, caplog):
    with Checkpointer(tmp_path, keep=3) as ckpt:
        save_steps(ckpt, [1, 2])
    _truncate_array_files(tmp_path / "2")

    ckpt = Checkpointer(tmp_path, keep=3)
    assert ckpt.latest_step() == 2
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        restored = ckpt.restore(single_device(make_state(1)))
    assert restored.step == 1 and restored.data_state == {"pos": 1}
    assert_trees_equal(restored.state, make_state(1))
    warnings = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert any("step 2" in w and "cannot be restored" in w for w in warnings), warnings

    # The unreadable step is set aside, so the resumed run can write step 2 again.
    assert (tmp_path / "2.corrupt").is_dir()
    assert ckpt.all_steps() == [1]
    assert ckpt.save(2, make_state(2), data_state={"pos": 2}, config=CONFIG)
    ckpt.wait()
    assert_trees_equal(ckpt.restore(single_device(make_state(2))).state, make_state(2))
    ckpt.close()


def test_all_corrupted_raises_naming_the_directory(tmp_path):
    with Checkpointer(tmp_path, keep=3) as ckpt:
        save_steps(ckpt, [1, 2])
    for step in (1, 2):
        _truncate_array_files(tmp_path / str(step))
    with Checkpointer(tmp_path, keep=3) as ckpt:
        with pytest.raises(CheckpointError, match=f"none of the checkpoints in {tmp_path}"):
            ckpt.restore(single_device(make_state(1)))
        assert ckpt.all_steps() == [1, 2]  # nothing is set aside when nothing restores


def _overwrite_every_file(step_dir: pathlib.Path) -> None:
    """Garbage of the same size in every file of a checkpoint (metadata, metrics, arrays)."""
    for path in step_dir.rglob("*"):
        if path.is_file():
            path.write_bytes(b"\xde\xad" * (path.stat().st_size // 2 + 1))


def test_every_file_overwritten_raises_and_moves_nothing(tmp_path):
    with Checkpointer(tmp_path, keep=3) as ckpt:
        save_steps(ckpt, [1, 2], losses=[2.0, 1.0])
    for step in (1, 2):
        _overwrite_every_file(tmp_path / str(step))
    with Checkpointer(tmp_path, keep=3) as ckpt:  # orbax would fail on the metrics items
        assert ckpt.all_steps() == [1, 2]
        for restore in (ckpt.restore_config, lambda: ckpt.restore(single_device(make_state(1)))):
            with pytest.raises(CheckpointError) as info:
                restore()
            message = str(info.value)
            assert len(message.splitlines()) == 1, message
            assert f"none of the checkpoints in {tmp_path} (steps [1, 2])" in message
            assert "pass --fresh" in message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["1", "2"]


def test_an_unreadable_metrics_item_is_set_aside_once_an_older_one_restores(tmp_path, caplog):
    with Checkpointer(tmp_path, keep=3) as ckpt:
        save_steps(ckpt, [1, 2, 3], losses=[1.0, 2.0, 3.0])  # step 1 is best
    (tmp_path / "3" / "metrics" / "metrics").write_text("{")
    with Checkpointer(tmp_path, keep=2) as ckpt:
        assert ckpt.latest_step() == 3  # not moved before a restore says which one is used
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            assert ckpt.restore(single_device(make_state(2))).step == 2
        assert ckpt.all_steps() == [1, 2] and (tmp_path / "3.corrupt").is_dir()
        warnings = [r.getMessage() for r in caplog.records if r.name == LOGGER]
        assert len(warnings) == 1 and "3/metrics/metrics is unreadable" in warnings[0], warnings
        save_steps(ckpt, [3, 4])  # the metrics were read again: step 1 is still the best
        assert ckpt.all_steps() == [1, 3, 4]


def _damage(step_dir: pathlib.Path, key: str, index: int) -> None:
    """Changes one element of array ``key`` in place: the checkpoint stays readable, as after
    flipped bits that a compressed chunk still decodes."""
    import tensorstore as ts

    kvstore = {"driver": "ocdbt", "base": f"file://{step_dir}/state/", "path": f"{key}/"}
    array = ts.open({"driver": "zarr", "kvstore": kvstore}).result()
    array[index].write(array[index].read().result() + 1).result()


def test_damaged_array_data_are_detected_and_the_previous_one_used(tmp_path, caplog):
    mesh = jax.make_mesh((2, 4), ("data", "model"), devices=jax.devices()[:8])
    with Checkpointer(tmp_path, keep=3) as ckpt:
        for step in (1, 2):
            ckpt.save(step, make_state(step, mesh), data_state={}, config=CONFIG)
        ckpt.wait()
    _damage(tmp_path / "2", "params.kernel", (5, 9))
    # Restored onto another mesh: the fingerprints do not depend on the sharding.
    mesh_42 = jax.make_mesh((4, 2), ("data", "model"), devices=jax.devices()[:8])
    target = onto(make_state(1), lambda _: NamedSharding(mesh_42, P()))
    with Checkpointer(tmp_path, keep=3) as ckpt:
        with pytest.raises(CheckpointError, match=r"step 2 .*DamagedArrayError: .*\['kernel'\]"):
            ckpt.restore(target, step=2)
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            restored = ckpt.restore(target)
        assert restored.step == 1
        assert_trees_equal(restored.state, make_state(1))
    assert (tmp_path / "2.corrupt").is_dir()
    assert any("DamagedArrayError" in r.getMessage() for r in caplog.records)


def test_checkpoints_without_fingerprints_still_restore(tmp_path):
    with Checkpointer(tmp_path, keep=3) as ckpt:
        save_steps(ckpt, [1])
    shutil.rmtree(tmp_path / "1" / "fingerprints")  # as written before they were recorded
    with Checkpointer(tmp_path, keep=3) as ckpt:
        assert_trees_equal(ckpt.restore(single_device(make_state(1))).state, make_state(1))


def test_changed_shapes_are_not_an_unreadable_checkpoint(tmp_path):
    with Checkpointer(tmp_path, keep=3) as ckpt:
        save_steps(ckpt, [1, 2])
    target = single_device(make_state(1))
    wider = jax.ShapeDtypeStruct((8, 32), jnp.float32, sharding=target["opt"]["mu"].sharding)
    target["params"]["kernel"] = target["opt"]["mu"] = wider
    with Checkpointer(tmp_path, keep=3) as ckpt:
        with pytest.raises(CheckpointShapeError) as info:
            ckpt.restore(target)
        assert str(info.value) == (
            f"checkpoint step 2 in {tmp_path} holds other arrays than this model: "
            "opt/mu has shape (8, 16) there, (8, 32) here (2 arrays differ)"
        )
        assert ckpt.all_steps() == [1, 2]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["1", "2"]


KILLED_RUN = textwrap.dedent(
    """
    import pathlib, sys
    import jax.numpy as jnp
    from flaxformer_lite.train.checkpoint import Checkpointer

    ckpt = Checkpointer(pathlib.Path(sys.argv[1]), keep=2, async_save=True)
    for step in range(1, 1000):
        # 64 MB, so that writing it takes a while.
        state = {"x": jnp.arange(16_000_000, dtype=jnp.float32) + step, "step": jnp.asarray(step)}
        ckpt.save(step, state, data_state={"pos": step}, config={"run": "killed"})
        # save() waited for step - 1 to commit; step is being written in the background now.
        print(step, flush=True)
    """
)


def test_kill_9_during_async_save_keeps_last_finished_checkpoint(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    log = open(tmp_path / "child.log", "w")  # noqa: SIM115
    child = subprocess.Popen(
        [sys.executable, "-c", KILLED_RUN, str(tmp_path / "ckpt")],
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
        env=env,
    )
    watchdog = threading.Timer(120, child.kill)
    watchdog.start()
    try:
        started = 0
        while started < 3:
            line = child.stdout.readline()
            assert line, f"the child died: {(tmp_path / 'child.log').read_text()[-2000:]}"
            started = int(line)
        child.send_signal(signal.SIGKILL)  # while step 3 is being written
        child.wait()
    finally:
        watchdog.cancel()
        log.close()
    assert child.returncode == -signal.SIGKILL

    directory = tmp_path / "ckpt"
    ckpt = Checkpointer(directory, keep=2)
    latest = ckpt.latest_step()
    assert latest in (2, 3), sorted(p.name for p in directory.iterdir())
    unfinished = {int(p.name.split(".")[0]) for p in directory.iterdir() if not p.name.isdigit()}
    assert not unfinished & set(ckpt.all_steps())
    device = SingleDeviceSharding(jax.devices()[0])
    target = {
        "x": jax.ShapeDtypeStruct((16_000_000,), jnp.float32, sharding=device),
        "step": jax.ShapeDtypeStruct((), jnp.int32, sharding=device),
    }
    restored = ckpt.restore(target)
    assert restored.step == latest and restored.data_state == {"pos": latest}
    assert int(restored.state["step"]) == latest
    np.testing.assert_array_equal(
        np.asarray(restored.state["x"]), np.arange(16_000_000, dtype=np.float32) + latest
    )
    # The resumed run writes the next step over whatever the killed save left behind.
    step = latest + 1
    state = {"x": jnp.arange(16_000_000, dtype=jnp.float32) + step, "step": jnp.asarray(step)}
    assert ckpt.save(step, state, data_state={"pos": step}, config={"run": "resumed"})
    ckpt.wait()
    assert ckpt.latest_step() == step
    assert ckpt.restore_config() == {"run": "resumed"}
    ckpt.close()
