"""Test setup: 8 simulated CPU devices, float32 matmuls at full precision, and compiling fast.

XLA reads ``XLA_FLAGS`` once, when the backend starts, so the flag is set here before any
test module imports jax. Tests that need several devices use ``jax.devices()[:n]``.

Compiling is most of the suite's time on a CPU:

* JAX's persistent compilation cache is on, in one directory for the whole session. It is set
  up through environment variables, so this process, the pytest-xdist workers (started with
  its environment after this file is imported) and the subprocesses tests start share it:
  the subprocesses write it, every process reads it (in-process compiles are not written,
  see below). Several end-to-end tests compile the same programs (the default run's train
  step above all): what one subprocess compiled, the others and the workers read back. The
  cache is keyed by the program, the compile options, the XLA flags and the devices, so a
  hit runs the very executable a compile would have produced.
  Set ``JAX_COMPILATION_CACHE_DIR`` yourself to keep a cache between sessions; otherwise a
  temporary one is removed at the end of the session.
* A module marked ``pytestmark = pytest.mark.fast_compile`` compiles with XLA's LLVM backend
  optimizations off (JAX's ``jax_disable_most_optimizations``, what the XLA flag
  ``--xla_backend_optimization_level=0`` does) and with XLA:CPU's elemental emitters
  (tests/fast_compile.py): a fraction of the compile time, the same values up to float32
  round-off, slower to run. A test in it that runs a program for hundreds of
  steps, where the optimizations pay, asks for them back with the ``full_optimization``
  fixture. Subprocesses started with ``subprocess_env.subprocess_env`` compile the same way.
  Unmarked modules compile as users' programs do.
"""

import gc
import os
import pathlib
import shutil
import sys
import tempfile
import threading

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()

_OWN_CACHE = "FLAXFORMER_LITE_TEST_CACHE_OWNER"  # the pid of the process that made the cache
if not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="flaxformer-lite-jax-cache-")
    os.environ[_OWN_CACHE] = str(os.getpid())
# Programs that take a moment to compile are cached. A size limit turns on JAX's file lock, so
# that processes compiling the same program at once never read a half-written entry.
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(8 * 2**30))

from flaxformer_lite import process  # noqa: E402

# The session is a program: it chooses its backends as the commands do (the workers and the
# subprocesses inherit the choice), importing the package chooses nothing.
process.skip_absent_tpu()

import fast_compile  # noqa: E402
import jax  # noqa: E402
import pytest  # noqa: E402
from quick_tier import QUICK_FILES  # noqa: E402
from shared_dirs import shared_across_workers  # noqa: E402
from tiny_runs import SHARED_RUNS, TRANSLATION  # noqa: E402

# Reference comparisons at float32 round-off need full-precision matmuls on every backend.
jax.config.update("jax_default_matmul_precision", "highest")
# This process (a worker's in-process tests) reads the session's cache but writes nothing to it:
# XLA:CPU's serialization of an executable for the cache (jax's put_executable_and_time) has
# crashed a long-lived worker (SIGSEGV, SIGABRT) in full runs, never a test's short subprocess,
# and the subprocesses keep writing it (JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS below). The
# worker also compiles one program at a time (fast_compile.one_compile_at_a_time).
jax.config.update("jax_persistent_cache_min_compile_time_secs", 1e9)

_NO_OPTIMIZATIONS = "jax_disable_most_optimizations"


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "fast_compile: compile the module's programs with XLA's backend optimizations "
        "off (see tests/conftest.py)",
    )
    config.addinivalue_line(
        "markers", "quick: the quick tier, `pytest -m quick` (see tests/quick_tier.py)"
    )


def pytest_collection_modifyitems(config, items):
    """Marks the quick tier: the tests of :data:`quick_tier.QUICK_FILES` not marked slow."""
    for item in items:
        if item.path.name in QUICK_FILES and item.get_closest_marker("slow") is None:
            item.add_marker(pytest.mark.quick)


# Tests whose worker crashed once: XLA:CPU's compiler has also crashed a worker (SIGSEGV in
# backend_compile_and_load) at a test that then passes on its own. Such a test runs once more on
# a fresh worker; a second crash fails it, as any crash did before.
_CRASHED: set[str] = set()


@pytest.hookimpl(optionalhook=True)
def pytest_handlecrashitem(crashitem, report, sched):
    """pytest-xdist's hook for a test whose worker died: rescheduled once."""
    if crashitem not in _CRASHED:
        _CRASHED.add(crashitem)
        sched.mark_test_pending(crashitem)
        report.outcome = "rerun"


def pytest_report_teststatus(report, config):
    if report.outcome == "rerun":
        return "rerun", "R", ("RERUN (its worker crashed)", {"yellow": True})
    return None


def pytest_unconfigure(config):
    if os.environ.get(_OWN_CACHE) == str(os.getpid()):
        shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)


fast_compile.add_to_unoptimized_compiles()
fast_compile.one_compile_at_a_time()


def _set_optimizations_off(off: bool):
    """Sets ``jax_disable_most_optimizations``, read when a program is compiled; returns the
    previous value."""
    previous = jax.config.values[_NO_OPTIMIZATIONS]
    jax.config.update(_NO_OPTIMIZATIONS, off)
    return previous


@pytest.fixture(scope="module", autouse=True)
def _caches_cleared_after_each_module():
    """A worker runs a thousand tests: the programs each module compiled are dropped when it
    ends (``jax.clear_caches``), so a long-lived worker does not carry every module's executables
    (late in full runs XLA:CPU has aborted workers that hold them)."""
    yield
    jax.clear_caches()
    gc.collect()


@pytest.fixture(scope="module", autouse=True)
def _fast_compile_modules(request):
    """Backend optimizations off for the modules marked ``fast_compile``. Module-scoped and
    autouse: set before the module's other fixtures, which may compile too."""
    if request.node.get_closest_marker("fast_compile") is None:
        yield
        return
    previous = _set_optimizations_off(True)
    yield
    _set_optimizations_off(previous)


@pytest.fixture(autouse=True)
def _keep_malloc_defaults(monkeypatch):
    """``train_main`` called in-process would set glibc's malloc for the rest of the worker's
    tests (``flaxformer_lite.process``); tests that need the setting start a process."""
    monkeypatch.setattr(process, "reuse_freed_host_memory", lambda: False)


@pytest.fixture(autouse=True)
def _keep_exception_hooks(monkeypatch):
    """``train_main`` or ``generate`` called in-process would send unraisable exceptions and
    threads' uncaught ones to a library log (``flaxformer_lite.cli.library_log``) for the rest
    of the worker's tests; pytest's hooks, which report them, are put back after each test."""
    monkeypatch.setattr(sys, "unraisablehook", sys.unraisablehook)
    monkeypatch.setattr(threading, "excepthook", threading.excepthook)


_PEAK_FLOPS = []  # this worker's measured peak, once it is measured


@pytest.fixture(autouse=True)
def _peak_flops_once_per_worker(monkeypatch):
    """On a CPU every run of the training loop measures the host's peak FLOP/s for its MFU, a
    2048^3 matmul timed 6 times (about 2 s on a small machine: more than many short runs take to
    train). The peak is the host's, so a worker measures it once, at its first run, and its later
    in-process runs reuse it; ``peak_flops.peak_flops`` itself, the benchmarks and the subprocesses
    measure as before."""
    from flaxformer_lite.train import loop, peak_flops

    def once():
        if not _PEAK_FLOPS:
            _PEAK_FLOPS.append(peak_flops.peak_flops())
        return _PEAK_FLOPS[0]

    monkeypatch.setattr(loop, "peak_flops", once)


@pytest.fixture
def full_optimization():
    """XLA's backend optimizations on for what the test compiles: for runs of many steps."""
    previous = _set_optimizations_off(False)
    yield
    _set_optimizations_off(previous)


@pytest.fixture
def rng():
    """A fresh typed PRNG key per test."""
    return jax.random.key(0)


NEEDS_EXTRA = "needs the optional test extra (torch, transformers): pip install -e '.[dev]'"


@pytest.fixture(scope="session")
def hf():
    """``hf.torch`` and ``hf.transformers``, the reference implementations of the interop
    tests, imported once (the import takes seconds); the test is skipped, saying why, when the
    optional test extra is not installed."""
    import types

    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local directories only, never the network
    torch = pytest.importorskip("torch", reason=NEEDS_EXTRA)
    transformers = pytest.importorskip("transformers", reason=NEEDS_EXTRA)
    transformers.logging.set_verbosity_error()
    return types.SimpleNamespace(torch=torch, transformers=transformers)


def _train_unoptimized(config, overrides: list[str], log=lambda _: None) -> None:
    """The training loop on ``config`` (a path, or None for the embedded default) with
    ``overrides``, compiled as the ``fast_compile`` modules compile."""
    from flaxformer_lite.train.config import load_config
    from flaxformer_lite.train.loop import run

    previous = _set_optimizations_off(True)
    try:
        run(load_config(config, overrides), progress=False, log=log)
    finally:
        _set_optimizations_off(previous)


@pytest.fixture(scope="session")
def trained_runs(tmp_path_factory):
    """``trained_runs(name)``: the run directory of ``tiny_runs.SHARED_RUNS[name]``, trained
    once per session for every test file that needs such a run (with XLA's backend
    optimizations off, as the ``fast_compile`` modules compile). Read it only: a test that
    writes into a run (resumes it, damages it) works on a ``shutil.copytree`` of it."""

    def trained(name):
        def train(directory):
            _train_unoptimized(None, [f"run_dir={directory / 'run'}", *SHARED_RUNS[name]])

        return shared_across_workers(tmp_path_factory, f"trained_{name}", train)[0] / "run"

    return trained


@pytest.fixture(scope="session")
def trained_translation(tmp_path_factory):
    """``(run_dir, log)``: ``tiny_runs.TRANSLATION`` on 300 parallel sentences of the
    ``number_words`` generator (``pairs.tsv`` beside the run), trained once per session as
    ``trained_runs``' runs are, and the lines its loop logged. Read it only."""
    from flaxformer_lite.data import synthetic

    def train(directory):
        task = synthetic.make_generator("number_words", split="train", seed=0, size=300)
        pairs = directory / "pairs.tsv"
        pairs.write_text("".join(f"{task[i]['source']}\t{task[i]['target']}\n" for i in range(300)))
        config = pathlib.Path(__file__).parents[1] / "configs" / "transformer_tiny.yaml"
        log = []
        _train_unoptimized(
            config, [f"run_dir={directory / 'run'}", f"data.path={pairs}", *TRANSLATION], log.append
        )
        return log

    directory, log = shared_across_workers(tmp_path_factory, "trained_translation", train)
    return directory / "run", log
