"""Host memory reuse: with glibc keeping freed memory, XLA's per-call temporary buffers stop
faulting in fresh pages (``flaxformer_lite.process``)."""

import os
import platform
import subprocess
import sys

import pytest

from flaxformer_lite import process
from flaxformer_lite.cli.train import train_main

# A jitted function whose temporaries (4 MiB each) XLA's worker threads allocate and free on
# every call; it prints the minor page faults per call once warm. "reuse" makes the setting
# where train.py does: after the CLI module is imported, before JAX is (and its backend starts).
FAULTS_PER_CALL = """
import resource, sys
if sys.argv[1] == "reuse":
    import flaxformer_lite.cli.train
    from flaxformer_lite.process import reuse_freed_host_memory
    assert reuse_freed_host_memory()
import jax, jax.numpy as jnp
x = jnp.ones((1024, 1024)) / 1024
@jax.jit
def f(x):
    y = jnp.tanh(x @ x)
    z = jnp.tanh(y @ x)
    return (y @ z + jnp.tanh(z @ y) @ x).sum()
for _ in range(3):
    f(x).block_until_ready()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    f(x).block_until_ready()
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 5)
"""


def faults_per_call(mode: str) -> float:
    env = os.environ | {"JAX_PLATFORMS": "cpu"}
    done = subprocess.run(
        [sys.executable, "-c", FAULTS_PER_CALL, mode],
        capture_output=True,
        text=True,
        check=True,
        env=env,
    )
    return float(done.stdout.split()[-1])


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")
def test_freed_xla_buffers_are_reused_instead_of_faulted_in_again():
    plain, reused = faults_per_call("plain"), faults_per_call("reuse")
    assert plain > 4096  # 16 MiB of pages fault in afresh on every call, at least
    assert reused < plain / 20


def test_train_py_reuses_freed_host_memory(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(process, "reuse_freed_host_memory", lambda: calls.append(1) or True)
    assert train_main([f"init_from={tmp_path / 'missing'}", f"run_dir={tmp_path / 'run'}"]) == 2
    assert calls == [1]
