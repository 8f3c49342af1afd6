"""The commands' backends: libtpu on a host without TPU chips makes them start the CPU alone,
without libtpu's start-up warnings; a host with chips, a GPU plugin or the user's
``JAX_PLATFORMS`` is left to jax. Importing the package chooses nothing: a script's process is
its own (``flaxformer_lite.process``)."""

import glob
import importlib.util
import os
import subprocess
import sys
import types

import jax
import pytest
from jax._src import hardware_utils

from flaxformer_lite import process as platforms

GUARDED = (
    "from flaxformer_lite.cli.errors import guarded; import jax; "
    "guarded(lambda: print(jax.config.jax_platforms, jax.devices()[0].platform) or 0)"
)


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu not installed")
@pytest.mark.parametrize("first", ["jax", "flaxformer_lite"])
def test_a_command_on_a_host_without_tpu_chips_starts_the_cpu_quietly(first):
    """A command started after jax's import sets jax's config; before it, ``JAX_PLATFORMS``."""
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    code = f"import {first}, sys; print('jax' in sys.modules); {GUARDED}"
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [str(first == "jax"), "cpu", "cpu"]
    assert "TPU" not in result.stderr, result.stderr


@pytest.mark.parametrize(
    "case", ["tpu chips", "jax's test moved", "gpu plugin", "user's choice", "no libtpu"]
)
def test_the_choice_is_left_to_jax_unless_libtpu_has_no_chips(monkeypatch, case):
    updates = []
    monkeypatch.setattr(jax.config, "update", lambda *args: updates.append(args))
    monkeypatch.setenv("JAX_PLATFORMS", "")  # unset for the check; restored after the test
    monkeypatch.setattr(platforms.importlib.util, "find_spec", lambda name: object())
    monkeypatch.setattr(platforms, "tpu_chip_count", lambda: 0)
    monkeypatch.setattr(platforms.importlib.metadata, "distributions", lambda: [])
    platforms.skip_absent_tpu()
    assert updates == [("jax_platforms", "cpu")]  # libtpu, no chips, no other plugin
    assert os.environ["JAX_PLATFORMS"] == ""  # jax imported: its config, not the environment
    with monkeypatch.context() as before_jax:
        before_jax.setattr(platforms, "sys", types.SimpleNamespace(modules={}))
        platforms.skip_absent_tpu()
    assert updates == [("jax_platforms", "cpu")] and os.environ["JAX_PLATFORMS"] == "cpu"
    monkeypatch.setenv("JAX_PLATFORMS", "")
    updates.clear()
    if case == "tpu chips":
        monkeypatch.setattr(platforms, "tpu_chip_count", lambda: 4)
    elif case == "jax's test moved":
        monkeypatch.setattr(platforms, "tpu_chip_count", lambda: None)
    elif case == "gpu plugin":

        class Plugin:
            metadata = {"Name": "jax-cuda12-plugin"}

        monkeypatch.setattr(platforms.importlib.metadata, "distributions", lambda: [Plugin()])
    elif case == "user's choice":
        monkeypatch.setenv("JAX_PLATFORMS", "tpu,cpu")
    else:
        monkeypatch.setattr(platforms.importlib.util, "find_spec", lambda name: None)
    with monkeypatch.context() as before_jax:
        before_jax.setattr(platforms, "sys", types.SimpleNamespace(modules={}))
        platforms.skip_absent_tpu()
    platforms.skip_absent_tpu()
    assert updates == []
    assert os.environ["JAX_PLATFORMS"] == ("tpu,cpu" if case == "user's choice" else "")


def test_tpu_chips_are_counted_by_jaxs_own_test_run_from_its_file(monkeypatch, tmp_path):
    """``tpu_chip_count`` runs jax's ``hardware_utils`` from its file: on this host it agrees
    with the imported module, it reads the PCI devices as jax does (two TPU v4 chips and a
    device of another vendor, faked), a failure in it is None (left to jax), and it imports
    no JAX."""
    assert platforms.tpu_chip_count() == hardware_utils.num_available_tpu_chips_and_device_id()[0]
    devices = {"a": ("0x1ae0", "0x005e"), "b": ("0x1ae0", "0x005e"), "c": ("0x10de", "0x005e")}
    for name, (vendor, device) in devices.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "vendor").write_text(vendor + "\n")
        (tmp_path / name / "device").write_text(device + "\n")
    monkeypatch.setattr(glob, "glob", lambda pattern: sorted(map(str, tmp_path.glob("*/vendor"))))
    assert platforms.tpu_chip_count() == 2
    (tmp_path / "a" / "device").unlink()  # jax's test raises FileNotFoundError
    assert platforms.tpu_chip_count() is None
    code = "import sys; from flaxformer_lite import process; n = process.tpu_chip_count(); "
    code += "print(isinstance(n, int), 'jax' in sys.modules)"
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert (child.returncode, child.stdout) == (0, "True False\n"), child.stderr


def test_importing_the_package_changes_neither_the_environment_nor_jax():
    """Issue 64: ``import flaxformer_lite`` (and its public names) leaves ``JAX_PLATFORMS``
    unset, jax's config as it was, and jax itself unimported."""
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    code = "import os, flaxformer_lite; print(os.environ.get('JAX_PLATFORMS'))"
    child = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert (child.returncode, child.stdout) == (0, "None\n"), child.stderr
    code = (
        "import os, sys, jax; before = jax.config.jax_platforms; import flaxformer_lite; "
        "flaxformer_lite.load_run, flaxformer_lite.sweep, flaxformer_lite.register_norm; "
        "print(os.environ.get('JAX_PLATFORMS'), jax.config.jax_platforms == before)"
    )
    child = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert (child.returncode, child.stdout) == (0, "None True\n"), child.stderr
    code = "import sys, flaxformer_lite; print('jax' in sys.modules)"
    child = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert (child.returncode, child.stdout) == (0, "False\n"), child.stderr


def test_load_run_prints_nothing(tmp_path):
    """Issue 45 item 5: Orbax's "read only" warning of ``load_run``, in a script that chose
    its backend (libtpu's own start-up warnings are the script's choice since issue 64). The
    run is a tiny one, trained by the command."""
    from subprocess_env import subprocess_env
    from tiny_runs import TINY

    env = subprocess_env(1)
    train = [sys.executable, "-m", "flaxformer_lite.train", f"run_dir={tmp_path}/run"]
    trained = subprocess.run(
        [*train, *TINY, "train.steps=2"], env=env, capture_output=True, text=True, timeout=300
    )
    assert trained.returncode == 0, trained.stderr
    script = (
        "import flaxformer_lite, jax.numpy as jnp; jnp.ones(1).block_until_ready(); "
        f"print(flaxformer_lite.load_run({str(tmp_path / 'run')!r}).step)"
    )
    child = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert (child.returncode, child.stdout, child.stderr) == (0, "2\n", ""), child.stderr
