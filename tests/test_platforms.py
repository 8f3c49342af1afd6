"""The commands' backends: libtpu on a host without TPU chips makes them start the CPU alone,
without libtpu's start-up warnings; a host with chips, a GPU plugin or the user's
``JAX_PLATFORMS`` is left to jax."""

import importlib.util
import os
import subprocess
import sys

import jax
import pytest
from jax._src import hardware_utils

from flaxformer_lite.cli import platforms

GUARDED = (
    "import jax; from flaxformer_lite.cli.errors import guarded; "
    "guarded(lambda: print(jax.config.jax_platforms, jax.devices()[0].platform) or 0)"
)


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu not installed")
def test_a_command_on_a_host_without_tpu_chips_starts_the_cpu_quietly():
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    result = subprocess.run(
        [sys.executable, "-c", GUARDED], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["cpu", "cpu"]
    assert "TPU" not in result.stderr, result.stderr


@pytest.mark.parametrize("case", ["tpu chips", "gpu plugin", "user's choice", "no libtpu"])
def test_the_choice_is_left_to_jax_unless_libtpu_has_no_chips(monkeypatch, case):
    updates = []
    monkeypatch.setattr(jax.config, "update", lambda *args: updates.append(args))
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    monkeypatch.setattr(platforms.importlib.util, "find_spec", lambda name: object())
    monkeypatch.setattr(hardware_utils, "num_available_tpu_chips_and_device_id", lambda: (0, None))
    monkeypatch.setattr(platforms.importlib.metadata, "distributions", lambda: [])
    platforms.skip_absent_tpu()
    assert updates == [("jax_platforms", "cpu")]  # libtpu, no chips, no other plugin
    updates.clear()
    if case == "tpu chips":
        monkeypatch.setattr(hardware_utils, "num_available_tpu_chips_and_device_id", lambda: (4, 5))
    elif case == "gpu plugin":

        class Plugin:
            metadata = {"Name": "jax-cuda12-plugin"}

        monkeypatch.setattr(platforms.importlib.metadata, "distributions", lambda: [Plugin()])
    elif case == "user's choice":
        monkeypatch.setenv("JAX_PLATFORMS", "tpu,cpu")
    else:
        monkeypatch.setattr(platforms.importlib.util, "find_spec", lambda name: None)
    platforms.skip_absent_tpu()
    assert updates == []
