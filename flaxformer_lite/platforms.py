"""Which JAX backends start once ``flaxformer_lite`` is imported (by a command or a user's
script): all that jax finds, but for libtpu on a host without TPU chips.

libtpu (the ``tpu`` extra, which ``dev`` pulls in to compile for TPUs on any host) makes JAX try a
TPU backend at start-up, and on a host without TPU chips it prints warnings about TPU hostnames
before JAX falls back to the CPU. There, with no other accelerator plugin installed, importing the
package asks JAX for the CPU alone: the same backend, without the warnings. A ``JAX_PLATFORMS``
the user set is kept, and so is a backend already started.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os

_ACCELERATOR_PLUGINS = ("jax-cuda", "jax_cuda", "jax-rocm", "jax_rocm")


def skip_absent_tpu() -> None:
    """Makes the CPU JAX's only backend when libtpu is installed, the host has no TPU chips
    and no GPU plugin is installed; call before any JAX backend starts."""
    if os.environ.get("JAX_PLATFORMS") or importlib.util.find_spec("libtpu") is None:
        return
    try:
        from jax._src import hardware_utils  # jax's own test, as cloud_tpu_init uses it
    except ImportError:  # moved in another jax version: leave the choice to jax
        return
    if hardware_utils.num_available_tpu_chips_and_device_id()[0]:
        return
    names = (dist.metadata["Name"] or "" for dist in importlib.metadata.distributions())
    if any(name.startswith(_ACCELERATOR_PLUGINS) for name in names):
        return
    import jax

    jax.config.update("jax_platforms", "cpu")
