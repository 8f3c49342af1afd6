"""Stopping a run on SIGTERM / SIGINT: the handler only sets a flag; the loop reads it after
each step, agreed by all processes, and stops at a step where it can save a checkpoint."""

from __future__ import annotations

import contextlib
import signal

import jax
import jax.numpy as jnp
import numpy as np


class Interrupted(RuntimeError):  # noqa: N818 - raised on a signal, not an error of the run
    """SIGTERM or SIGINT arrived: a checkpoint was written and the run (or a sweep's
    ``members`` trained together) stopped."""

    def __init__(self, signum: int, step: int, members: tuple[str, ...] = ()):
        saved = "checkpoint saved"
        if members:
            shown = ", ".join(members[:4]) + (f", ... ({len(members)} in all)" * (len(members) > 4))
            saved = f"checkpoints saved of the members {shown}"
        super().__init__(
            f"{signal.Signals(signum).name} at step {step}: {saved}; run the same command to resume"
        )
        self.signum, self.step, self.members = signum, step, members


class _StopFlag:
    signum: int | None = None


@contextlib.contextmanager
def stop_on_signals():
    """Turns SIGTERM / SIGINT into a flag (``.signum``) the loop checks after each step."""
    flag = _StopFlag()

    def handler(signum, _frame):
        flag.signum = signum

    previous = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield flag
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


class SignalAgreement:
    """The signal any process received, the same on all of them: they must stop at the same
    step, since the checkpoint they then write is collective (a process saving alone would wait
    forever for the others, already in the next step's collectives).

    With several processes the agreement is a max over the processes' signals queued behind each
    step and read one step late, like the finite flag: a blocking exchange every step would
    make the host wait for the devices. All processes read the same step's agreement, so all
    stop one step after the signal, at the same step."""

    def __init__(self):
        self._pending = None
        if jax.process_count() > 1:
            mesh = jax.sharding.Mesh(np.array(jax.devices()), ("devices",))
            self._sharding = jax.NamedSharding(mesh, jax.P("devices"))
            self._max = jax.jit(jnp.max, out_shardings=jax.NamedSharding(mesh, jax.P()))

    def __call__(self, signum: int | None) -> int | None:
        """The agreed signal, given this process's ``signum`` after a step (None: none)."""
        if jax.process_count() == 1:
            return signum
        local = np.full(jax.local_device_count(), signum or 0, np.int32)
        received = jax.make_array_from_process_local_data(
            self._sharding, local, (jax.device_count(),)
        )
        agreed, self._pending = self._pending, self._max(received)
        return None if agreed is None else int(agreed) or None
