"""How a command ends: an error the user can fix (config, data, files, the disk, a program too
large for the device's memory) prints one line and the command exits with status 2, without a
traceback; SIGINT / SIGTERM end it with 128 + signal (the training loop first saves a
checkpoint)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import sys
import traceback
from collections.abc import Callable

from flaxformer_lite.cli.library_log import plain_terminal_records
from flaxformer_lite.process import skip_absent_tpu
from flaxformer_lite.registry import trusted_code

# ValueError: bad settings and data (ConfigError is one); OSError: unreadable, unwritable or
# corrupt files, a full disk (CheckpointError is one).
USER_ERRORS = (ValueError, OSError)
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def guarded(fn: Callable[[], int], *, trust_code: bool = False) -> int:
    """``fn()``'s exit status, or 2 after printing ``error: ...`` for one of :data:`USER_ERRORS`
    or XLA's RESOURCE_EXHAUSTED (:func:`out_of_memory`); a stop signal while ``fn`` runs ends
    the process (:func:`exit_on_signals`). Log records on the terminal read ``warning: ...``.
    ``trust_code`` (``--trust-code``): ``fn`` imports the code settings name by import path.
    Every command runs here, so the backends are chosen here (:func:`~.process.skip_absent_tpu`)."""
    skip_absent_tpu()
    plain_terminal_records()
    try:
        with exit_on_signals(), trusted_code(trust_code):
            return fn()
    except USER_ERRORS as error:
        say(f"error: {error}", stream=sys.stderr)
        return 2
    except Exception as error:
        if _backend_refused(error):
            say(f"error: {backend_refused(error)}", stream=sys.stderr)
            return 2
        if not _resource_exhausted(error):
            raise
        say(f"error: {out_of_memory(str(error))}", stream=sys.stderr)
        return 2


def _backend_refused(error: Exception) -> bool:
    """Whether ``error`` is JAX failing to start the platforms ``JAX_PLATFORMS`` names: its
    RuntimeError, or, for a platform whose plugin is not installed (``cuda``), an assertion in
    its backend set-up."""
    if isinstance(error, RuntimeError):
        return "Unable to initialize backend" in str(error)
    if isinstance(error, AssertionError) and error.__traceback__ is not None:
        last = traceback.extract_tb(error.__traceback__)[-1]
        return last.filename.endswith(os.path.join("jax", "_src", "xla_bridge.py"))
    return False


def backend_refused(error: Exception) -> str:
    """The line for a backend JAX could not start: what it said, and the setting that asked."""
    said = str(error).strip().splitlines()[0] if str(error).strip() else "no backend it names"
    asked = os.environ.get("JAX_PLATFORMS")
    where = f"JAX_PLATFORMS={asked}" if asked else "the default platform"
    return (
        f"JAX could not start {where} ({said}); set JAX_PLATFORMS to a platform this machine "
        "has (cpu, or the accelerator whose JAX plugin is installed), or unset it"
    )


def _resource_exhausted(error: Exception) -> bool:
    """Whether ``error`` is XLA's RESOURCE_EXHAUSTED. JAX is imported by the commands that run
    programs, not here: a command that never imported it raised no error of JAX's."""
    jax = sys.modules.get("jax")
    runtime_error = jax is not None and isinstance(error, jax.errors.JaxRuntimeError)
    return runtime_error and "RESOURCE_EXHAUSTED" in str(error)


# The sizes in XLA's out-of-memory messages: "12884901888 bytes", "2147483648B", "2.00GiB",
# "20.25G" (TPU).
_SIZE = r"(\d+(?:\.\d+)?) ?(bytes|B|[KMGT]i?B?)\b"
_USED_OF = re.compile(rf"Used {_SIZE} of {_SIZE}")  # TPU compiler: the program, the HBM
_FREE = re.compile(rf"allocate {_SIZE}.*? There are {_SIZE} free", re.DOTALL)  # TPU runtime
_ASKED = re.compile(rf"allocat\w*(?: request for)? {_SIZE}")  # CPU, GPU: one allocation


def out_of_memory(message: str) -> str:
    """The line for XLA's RESOURCE_EXHAUSTED ``message``: how much memory was asked for, of how
    much (from the message, else the device's limit or the host's memory), and what to do."""
    if found := _USED_OF.search(message):
        what = f"the program needs {_gib(*found.group(1, 2))} of {_gib(*found.group(3, 4))}"
    elif found := _FREE.search(message):
        what = f"{_gib(*found.group(1, 2))} asked for, {_gib(*found.group(3, 4))} free"
    else:
        from flaxformer_lite import parallel

        where, limit = parallel.device_memory_limit()
        has = f"the {where} has {limit / 2**30:.2f} GiB" if limit else f"on the {where}"
        found = _ASKED.search(message)
        what = f"{_gib(*found.group(1, 2))} asked for, {has}" if found else has
    xla = message.strip().splitlines()[0].removeprefix("RESOURCE_EXHAUSTED: ")
    return (
        f"out of memory: {what} (XLA: {xla}); flaxformer-lite compile with the same --config "
        "and overrides (--topology cpu-1, or the accelerator's) reports what a step needs; or "
        "use a smaller train.batch_size (train.grad_accum_steps keeps the batch)"
    )


def _gib(number: str, unit: str) -> str:
    power = "KMGT".find(unit[0]) + 1 if unit[0] in "KMGT" else 0
    return f"{float(number) * 1024**power / 2**30:.2f} GiB"


@contextlib.contextmanager
def exit_on_signals():
    """SIGINT / SIGTERM end the process at once with status 128 + signal and one line, whatever
    it is doing: a ``KeyboardInterrupt`` raised inside JAX's start-up (model initialization,
    compiling) leaves its threads in a state that crashes the interpreter's exit. Code that
    must finish something first (the training loop, a checkpoint) installs its own handler
    meanwhile. The previous handlers are restored after."""

    def stop(signum, _frame):
        say(f"stopped by {signal.Signals(signum).name}", stream=sys.stderr)
        os._exit(128 + signum)  # no interpreter shutdown: nothing of a half-built run to keep

    previous = {s: signal.signal(s, stop) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def notice(message: str) -> None:
    """Says ``message`` on stderr, as a notice: what the command did differently from what it
    was told, without stopping (stdout may be a command's result, as ``config``'s YAML)."""
    say(f"notice: {message}", stream=sys.stderr)


def say(message: str, stream=None) -> None:
    """Prints ``message`` to ``stream`` (default stdout) at once, so it shows before a long step.
    A reader that went away (``| head``) leaves the command to go on without this output."""
    stream = stream or sys.stdout
    try:
        print(message, file=stream, flush=True)
    except BrokenPipeError:
        # A run's steps and checkpoints matter more than its log: the stream then writes to
        # /dev/null (the way Python's signal docs give), its buffered bytes included.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, stream.fileno())
        os.close(devnull)
