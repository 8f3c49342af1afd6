"""Orbax's background save threads, stopped after a failed save (:func:`stop_background_saves`,
which :class:`~flaxformer_lite.train.checkpoint.Checkpointer` calls): the one place this package
reaches into Orbax's private modules.
"""

from __future__ import annotations

import threading

# Private: stopping a failed save's threads has no public API (orbax 0.11 - 0.12).
from orbax.checkpoint._src.futures import future as ocp_future


def stop_background_saves(timeout: float = 5.0) -> None:
    """Cancels orbax's save threads and wakes those waiting for a signal that a failed thread
    will never send (they wait for ``multihost.coordination_timeout()``, many minutes, and are
    not daemons), then joins them for at most ``timeout`` seconds each."""
    threads = [
        thread
        for thread in threading.enumerate()
        if isinstance(thread, ocp_future._SignalingThread) and thread.is_alive()
    ]
    for thread in threads:
        thread.cancel()
        ocp_future.set_signals(thread._receive_signals, operation_id=thread._operation_id)
    for thread in threads:
        threading.Thread.join(thread, timeout)  # orbax's join re-raises the cancellation
