"""Runs with Muon (``optimizer.name=muon``) and muP (``model.parametrization=mup``): the losses of
one device on a data x fsdp x tensor mesh (and a context mesh), a bit-exact resume, a sweep over
Muon's numbers trained as one program whose members equal their own runs, the one-line errors of
bad settings, and the Newton-Schulz FLOPs in the compile report.

The 8 devices are the simulated CPU devices of conftest.py; the one-device baseline comes from a
subprocess started with a single device.
"""

import json
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest
from parallel_helpers import E2E
from run_states import checkpointed_state
from subprocess_env import subprocess_env
from tiny_runs import TINY

from flaxformer_lite.cli import main
from flaxformer_lite.train.config import load_config
from flaxformer_lite.train.loop import run
from flaxformer_lite.train.metrics import read_metrics
from flaxformer_lite.train.sweep import sweep

pytestmark = pytest.mark.fast_compile  # XLA's backend optimizations off: conftest.py

REPO = pathlib.Path(__file__).resolve().parents[1]

# gpt2-tiny (d_model 64, 4 heads) at twice muP's base width: every muP multiplier is 2^k, not 1.
MUON_MUP = [
    "optimizer.name=muon",
    "model.parametrization=mup",
    "model.mup_base_width=32",
]
MESH_STEPS = 10
RTOL = 1e-5


def quiet(_message):
    pass


def losses_of(run_dir, key="loss"):
    return {r["step"]: r[key] for r in read_metrics(run_dir, log=None) if r.get(key) is not None}


def assert_relatively_close(losses, reference, rtol=RTOL):
    assert sorted(losses) == sorted(reference), (losses, reference)
    for step in reference:
        a, b = losses[step], reference[step]
        assert abs(a - b) <= rtol * max(abs(a), abs(b)), (step, losses, reference)


# --------------------------------------------------------------------------- 1. meshes
@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
    """``one_device()``: the losses and eval losses by step of the Muon + muP run on a single
    CPU device, in a subprocess started at the module's first mesh test and awaited only when
    its numbers are needed, so that it runs while that test's run does."""
    run_dir = tmp_path_factory.mktemp("muon_one_device") / "run"
    process = subprocess.Popen(
        [
            sys.executable,
            str(REPO / "train.py"),
            "--no-progress",
            f"run_dir={run_dir}",
            *E2E,
            *MUON_MUP,
            f"train.steps={MESH_STEPS}",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=subprocess_env(1, JAX_DEFAULT_MATMUL_PRECISION="highest"),
        cwd=REPO,
    )
    finished = []

    def numbers():
        if not finished:
            output, _ = process.communicate(timeout=400)
            assert process.returncode == 0, output
            assert "mesh: data 1 x fsdp 1 x tensor 1 (1 cpu device, 1 process)" in output, output
            finished.append((losses_of(run_dir), losses_of(run_dir, "eval_loss")))
        return finished[0]

    yield numbers
    if process.poll() is None:
        process.kill()
        process.wait()


@pytest.mark.parametrize(
    "mesh, summary",
    [
        (
            ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"],
            "mesh: data 2 x fsdp 2 x tensor 2 (8 cpu devices, 1 process)",
        ),
        (
            ["mesh.data=2", "mesh.context=2", "mesh.tensor=2"],
            "mesh: data 2 x fsdp 1 x context 2 x tensor 2 (8 cpu devices, 1 process)",
        ),
    ],
    ids=["data2_fsdp2_tensor2", "data2_context2_tensor2"],
)
def test_muon_with_mup_on_a_mesh_logs_the_losses_of_one_device(tmp_path, one_device, mesh, summary):
    messages = []
    cfg = load_config(
        None,
        [f"run_dir={tmp_path / 'run'}", *E2E, *MUON_MUP, f"train.steps={MESH_STEPS}", *mesh],
    )
    run(cfg, progress=False, log=messages.append)
    assert summary in messages, [m for m in messages if m.startswith("mesh")]
    said = [m for m in messages if m.startswith("optimizer: ")]
    # gpt2-tiny's fused q/k/v [D, 3, H, Dh] (3 matrices of one array), out, wi, wo: 64 x (192 +
    # 64 + 2 x 256) entries.
    assert len(said) == 1 and "muon for 4 arrays (49,152 parameters)" in said[0], said
    assert "muP at 2x its base width 32" in said[0], said
    losses, evals = one_device()
    assert sorted(losses) == [5, 10] and sorted(evals) == [MESH_STEPS]
    assert_relatively_close(losses_of(tmp_path / "run"), losses)
    assert_relatively_close(losses_of(tmp_path / "run", "eval_loss"), evals)


# --------------------------------------------------------------------------- 2. resume
def test_a_muon_run_interrupted_and_resumed_equals_the_uninterrupted_run(tmp_path):
    """6 steps straight, and 4 then resumed to 6 (checkpoints every 2): the same losses and
    the same parameters and optimizer state (Muon's momentum, AdamW's moments), bit for bit."""
    # A constant rate: a 4-step run's schedule is a 6-step run's first 4 steps.
    often = [*TINY, *MUON_MUP, "optimizer.schedule=constant", "checkpoint.every=2"]

    def train(name, steps):
        cfg = load_config(None, [f"run_dir={tmp_path / name}", *often, f"train.steps={steps}"])
        run(cfg, progress=False, log=quiet)

    train("straight", 6)
    train("resumed", 4)
    train("resumed", 6)
    straight = losses_of(tmp_path / "straight")
    assert sorted(straight) == [1, 2, 3, 4, 5, 6]
    assert losses_of(tmp_path / "resumed") == straight

    jax.tree.map(
        np.testing.assert_array_equal,
        checkpointed_state(tmp_path / "resumed", 6),
        checkpointed_state(tmp_path / "straight", 6),
    )


# --------------------------------------------------------------------------- 3. sweep
SWEEP_STEPS = 4
COMPARED = ("loss", "accuracy", "grad_norm", "learning_rate", "eval_loss", "eval_accuracy")


def numbers(run_dir):
    """Each logged record's results (not its throughput), by step."""
    return {
        r["step"]: {k: r[k] for k in COMPARED if k in r} for r in read_metrics(run_dir, log=None)
    }


def test_a_sweep_over_muon_s_rate_trains_one_program_and_each_member_equals_its_run(tmp_path):
    settings = [
        *TINY,
        *MUON_MUP,
        f"train.steps={SWEEP_STEPS}",
        "train.eval_every=4",
        "checkpoint.every=100",
        "optimizer.weight_decay=0.1",
        "seed=1",
    ]
    vary = {"optimizer.muon_lr_ratio": ["0.5", "2"]}
    names = ["muon_lr_ratio=0.5", "muon_lr_ratio=2"]
    lines = []
    cfg = load_config(None, [*settings, f"run_dir={tmp_path / 's'}"])
    sweep(cfg, vary, vmap=False, log=lines.append)
    assert lines[0] == "sweep: 2 members, 1 compiled program (2 members)", lines
    assert any(
        line.startswith("compiled one step for 2 members, run for each in turn") for line in lines
    ), lines
    logged = {name: numbers(tmp_path / "s" / name) for name in names}
    for name in names:
        assert max(logged[name]) == SWEEP_STEPS and "eval_loss" in logged[name][SWEEP_STEPS]
        solo = tmp_path / "solo" / name
        member_config = tmp_path / "s" / name / "config.yaml"
        assert main(["train", "--config", str(member_config), f"run_dir={solo}"]) == 0
        assert numbers(solo) == logged[name], name
    # The members differ: Muon's rate changes the losses.
    last = {name: logged[name][SWEEP_STEPS]["loss"] for name in names}
    assert len(set(last.values())) == 2, last


# --------------------------------------------------------------------------- 4. bad input
USER_PIECES = '''
import jax.numpy as jnp
from flax import nnx


class RawFeedForward(nnx.Module):
    """An MLP whose [D, F] and [F, D] kernels are bare nnx.Params: no logical axis names."""

    def __init__(self, cfg, *, num_layers, rngs):
        init = nnx.initializers.normal(0.02)
        self.w = nnx.Param(init(rngs.params(), (cfg.d_model, cfg.d_ff)))
        self.v = nnx.Param(init(rngs.params(), (cfg.d_ff, cfg.d_model)))

    def __call__(self, x):
        return jnp.maximum(x @ self.w[...], 0) @ self.v[...]


class NoMixer(nnx.Module):
    """Mixes nothing: no parameters."""

    def __init__(self, cfg, *, num_layers, rngs):
        pass

    def __call__(self, x, **kwargs):
        return x


class Gate(nnx.Module):
    """A feed-forward block of one [D] vector."""

    def __init__(self, cfg, *, num_layers, rngs):
        self.gate = nnx.Param(jnp.ones((cfg.d_model,)))

    def __call__(self, x):
        return x * self.gate[...]
'''

BAD = {
    "fused_grouped_qkv": (
        ["optimizer.name=muon", "model.fused_qkv=true", "model.num_kv_heads=2"],
        ["optimizer.name=muon", "model.fused_qkv"],
    ),
    "base_wider_than_d_model": (
        ["model.parametrization=mup", "model.mup_base_width=128"],
        ["model.mup_base_width (128)", "model.d_model (64)"],
    ),
    "mup_with_inverse_sqrt": (
        ["model.parametrization=mup", "model.mup_base_width=32"]
        + ["optimizer.schedule=inverse_sqrt", "optimizer.warmup_steps=10"],
        ["model.parametrization=mup", "optimizer.schedule=inverse_sqrt"],
    ),
    "mup_with_unknown_role": (
        [
            "--trust-code",
            "model.feed_forward={module}:RawFeedForward",
            "model.parametrization=mup",
            "model.mup_base_width=32",
        ],
        ["model.parametrization=mup", "mlp/", "model.feed_forward=", ":RawFeedForward"],
    ),
    "muon_without_hidden_matrix": (
        [
            "--trust-code",
            "model.mixer={module}:NoMixer",
            "model.feed_forward={module}:Gate",
            "optimizer.name=muon",
        ],
        ["optimizer.name=muon", "no hidden matrix"],
    ),
}


@pytest.fixture
def pieces_dir(tmp_path, monkeypatch):
    """``(directory, module)``: a user's module of pieces in the current directory."""
    name = "muon_pieces_" + str(abs(hash(tmp_path)))
    (tmp_path / f"{name}.py").write_text(USER_PIECES)
    monkeypatch.chdir(tmp_path)
    yield tmp_path, name
    sys.modules.pop(name, None)


@pytest.mark.parametrize("command", ["train", "sweep"])
@pytest.mark.parametrize("case", list(BAD))
def test_bad_muon_and_mup_settings_exit_2_with_one_line_and_write_nothing(
    pieces_dir, capsys, case, command
):
    directory, module = pieces_dir
    overrides, says = BAD[case]
    argv = [command, f"run_dir={directory / 'run'}", *TINY, "train.steps=2"]
    argv += [o.format(module=module) for o in overrides]
    if command == "sweep":
        argv += ["--vary", "seed=0,1"]
    status = main(argv)
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert status == 2, (out, err)
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for words in says:
        assert words in lines[0], (words, lines[0])
    assert not (directory / "run").exists()


# --------------------------------------------------------------------------- 5. FLOPs
CLI = "import sys; from flaxformer_lite.cli import main; sys.exit(main())"


def test_compile_counts_muon_s_newton_schulz_flops_for_v5e():
    """gpt2_small shrunk (one layer of width 128, 128 positions, a small vocabulary) compiled
    for 8 TPU v5e chips: XLA's count of the step's FLOPs is larger with Muon than with AdamW by
    the report's count of Newton-Schulz (5 iterations of 3 matmuls per matrix, counted by
    hand); the model's count, MFU's, is the same."""
    pytest.importorskip("libtpu", reason="compiling for a TPU topology needs libtpu")
    shrink = ["model.num_decoder_layers=1", "model.vocab_size=1024", "train.batch_size=8"]
    shrink += ["model.d_model=128", "model.num_heads=4", "model.d_ff=512", "data.seq_len=128"]
    summaries = {}
    for name in ("adamw", "muon"):
        # A process of its own: libtpu's compiler stays out of this worker's later programs
        # (and a run's default matmul precision, not conftest.py's "highest", which the
        # Pallas kernel refuses for bfloat16 blocks).
        argv = ["compile", "--config", "gpt2_small", "--topology", "v5e-8", *shrink]
        child = subprocess.run(
            [sys.executable, "-c", CLI, *argv, f"optimizer.name={name}"],
            capture_output=True,
            text=True,
            env=subprocess_env(1),
            cwd=REPO,
            timeout=300,
        )
        assert child.returncode == 0, child.stderr
        summaries[name] = json.loads(child.stdout.strip().splitlines()[-1])
    adamw, muon = summaries["adamw"], summaries["muon"]
    assert muon["flops_per_step"] == adamw["flops_per_step"] > 0
    print(f"XLA FLOPs per program: adamw {adamw['xla_flops_per_program']:.4g}, ", end="")
    print(f"muon {muon['xla_flops_per_program']:.4g}")
    # Muon's matrices: q, k, v and out [128, 128], the MLP's [128, 512] and [512, 128]; each
    # Newton-Schulz iteration on [m, n] (m <= n): X X^T, its square, their product with X.
    square, mlp = 4 * 128**3 + 2 * 128**3, 4 * 128 * 128 * 512 + 2 * 128**3
    newton_schulz = 5 * (4 * square + 2 * mlp)
    assert adamw["optimizer_flops_per_step"] == 0
    assert muon["optimizer_flops_per_step"] == newton_schulz  # data 8: every chip all of it
    difference = muon["xla_flops_per_program"] - adamw["xla_flops_per_program"]
    assert difference == pytest.approx(newton_schulz, rel=0.02)
