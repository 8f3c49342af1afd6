"""The persistent compilation cache (``train.compilation_cache``): a second run of a config
compiles nothing, a changed config compiles again, a corrupt entry is compiled again.

Each run is a ``train.py`` subprocess with its own ``XDG_CACHE_HOME``: JAX's cache settings are
the process's, and the session's own cache (``tests/conftest.py``) is kept out of it. The
subprocess counts its compilations with ``jax.monitoring``: every program JAX asks the backend
for, less those read back from the cache.
"""

import json
import os
import subprocess
import sys

import jax
import pytest
from subprocess_env import subprocess_env
from tiny_runs import TINY

from flaxformer_lite import process

# Runs train.py's main, then prints how many programs it compiled and read from the cache.
_COUNTING_TRAIN = """
import json, sys
from jax import monitoring
counts = {"programs": 0, "cache_hits": 0}
def program(event, duration_secs, **kwargs):
    if event == "/jax/core/compile/backend_compile_duration":
        counts["programs"] += 1
def hit(event, **kwargs):
    if event == "/jax/compilation_cache/cache_hits":
        counts["cache_hits"] += 1
monitoring.register_event_duration_secs_listener(program)
monitoring.register_event_listener(hit)
from flaxformer_lite.cli.train import train_main
status = train_main(sys.argv[1:])
print("COUNTS " + json.dumps(counts))
sys.exit(status)
"""

_SESSION_CACHE = (
    "JAX_COMPILATION_CACHE_DIR",
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
    "JAX_COMPILATION_CACHE_MAX_SIZE",
)


def _train(cache_home, run_dir, *overrides):
    """A tiny run in ``run_dir`` with ``cache_home`` as ``XDG_CACHE_HOME``: (compiled programs,
    cache hits, the completed process)."""
    environ = subprocess_env(1, XDG_CACHE_HOME=str(cache_home))
    environ = {k: v for k, v in environ.items() if k not in _SESSION_CACHE}
    argv = ["--no-progress", *TINY, "train.steps=2", f"run_dir={run_dir}", *overrides]
    done = subprocess.run(
        [sys.executable, "-c", _COUNTING_TRAIN, *argv],
        env=environ,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    counts = json.loads(done.stdout.split("COUNTS ")[-1])
    return counts["programs"] - counts["cache_hits"], counts["cache_hits"], done


@pytest.fixture(scope="module")
def warm_cache(tmp_path_factory):
    """A cache home after one tiny run, and the programs a run of its config asks for.

    Runs share the home in place: JAX keys an entry by its directory too (the compile options
    name it), so a copied cache is a cold one."""
    home = tmp_path_factory.mktemp("warm") / "cache"
    compiled, hits, _ = _train(home, home.parent / "first")
    assert hits == 0 and compiled > 0
    assert any((home / "flaxformer_lite" / "jax").iterdir())
    return home


def test_a_second_run_of_a_config_compiles_nothing(warm_cache, tmp_path):
    compiled, hits, _ = _train(warm_cache, tmp_path / "run")
    assert compiled == 0 and hits > 0


def test_a_changed_config_compiles_again(warm_cache, tmp_path):
    compiled, _, _ = _train(warm_cache, tmp_path / "run", "model.d_model=32")
    assert compiled > 0


def test_a_corrupt_entry_is_compiled_again(tmp_path):
    home = tmp_path / "cache"
    _train(home, tmp_path / "first")
    for entry in (home / "flaxformer_lite" / "jax").glob("*-cache"):
        entry.write_bytes(b"not an executable")
    compiled, hits, _ = _train(home, tmp_path / "again")
    assert hits == 0 and compiled > 0
    # JAX's warning, in the run's library log (flaxformer_lite.cli.library_log)
    library_log = (tmp_path / "again" / "library.log").read_text()
    assert "Error reading persistent compilation cache entry" in library_log


def test_the_setting_turns_the_cache_off(tmp_path):
    home = tmp_path / "cache"
    compiled, hits, _ = _train(home, tmp_path / "run", "train.compilation_cache=false")
    assert hits == 0 and compiled > 0
    assert not (home / "flaxformer_lite" / "jax").exists()


def test_a_cache_directory_the_user_gave_jax_is_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert process.user_cache_dir() == tmp_path / "flaxformer_lite"
    ours = jax.config.jax_compilation_cache_dir
    assert ours == os.environ["JAX_COMPILATION_CACHE_DIR"]  # tests/conftest.py's
    process.use_compilation_cache(True)
    assert jax.config.jax_compilation_cache_dir == ours
