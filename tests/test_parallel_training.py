"""Training on several meshes: identical losses on every mesh, checkpoints restored onto other
meshes, and a run resumed on another mesh.

The 8 devices are the simulated CPU devices of conftest.py; the one-device baseline of the
training runs comes from a subprocess started with a single device.
"""

import json
import pathlib
import re
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx
from parallel_helpers import E2E, TINY, B, T, flat, key_free, tiny
from shared_dirs import shared_across_workers
from subprocess_env import subprocess_env

from flaxformer_lite.data.tasks import TASKS
from flaxformer_lite.parallel import (
    DEFAULT_RULES,
    abstract_sharded,
    batch_sharding,
    create_sharded,
    make_mesh,
    put_batch,
    rule_pairs,
)
from flaxformer_lite.train.checkpoint import Checkpointer
from flaxformer_lite.train.checkpoint_format import from_savable, restore_target, to_savable
from flaxformer_lite.train.config import load_config
from flaxformer_lite.train.loop import run
from flaxformer_lite.train.step import make_train_step

pytestmark = pytest.mark.fast_compile  # XLA's backend optimizations off: conftest.py

REPO = pathlib.Path(__file__).resolve().parents[1]


def lm_batch(seed, vocab=TINY["vocab_size"]):
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, vocab, (B, T + 1)).astype(np.int32)
    return dict(inputs=ids[:, :-1], targets=ids[:, 1:], weights=np.ones((B, T), np.float32))


def relative_close(a, b, rtol=1e-5):
    return abs(a - b) <= rtol * max(abs(a), abs(b))


# --------------------------------------------------------------------------- same losses
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

    Shared by the xdist workers of this session (``shared_dirs``): the losses test and the
    resume test both need it, and it takes a while."""

    def train(directory):
        overrides = ("train.steps=20", "checkpoint.every=10", "mesh.data=2", "mesh.tensor=4")
        return train_in_process(directory / "run", *overrides)

    directory, messages = shared_across_workers(tmp_path_factory, "parallel_mesh_2x4", train)
    return directory / "run", messages


def test_a_data_fsdp_tensor_mesh_compiles_without_rematerialization(tmp_path):
    """Issue 45 item 6: the token lookup on data 2 x fsdp 2 x tensor 2 made XLA replicate its
    rows ("[SPMD] Involuntary full rematerialization", six times); the train and eval steps
    and the decoded evaluation now compile without it."""
    child = subprocess.run(
        [
            sys.executable,
            str(REPO / "train.py"),
            "--no-progress",
            f"run_dir={tmp_path / 'run'}",
            *E2E,
            *("train.steps=2", "train.eval_every=2", "train.decode_examples=2"),
            *("mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"),
        ],
        capture_output=True,
        text=True,
        env=subprocess_env(8),
        cwd=REPO,
        timeout=300,
    )
    assert child.returncode == 0, child.stderr
    assert "rematerialization" not in child.stderr, child.stderr


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


# --------------------------------------------------------------------------- restore reshards
@pytest.mark.slow
def test_a_checkpoint_restores_onto_other_meshes_bit_for_bit(tmp_path):
    # Scanned layers: the stacked parameters' leading "layers" axis is restored too.
    _, create = tiny(seed=1, num_decoder_layers=1, scan_layers=True)
    rules = DEFAULT_RULES
    source = make_mesh(2, 1, 4)
    graphdef, state, shardings = create_sharded(create, source, rules)
    step = make_train_step(graphdef, task=TASKS["lm"], state_shardings=shardings)
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
                target_graphdef, task=TASKS["lm"], state_shardings=target_shardings
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
