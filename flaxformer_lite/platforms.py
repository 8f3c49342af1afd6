"""Which JAX backends start once ``flaxformer_lite`` is imported (by a command or a user's
script): all that jax finds, but for libtpu on a host without TPU chips.

libtpu (the ``tpu`` extra, which ``dev`` pulls in to compile for TPUs on any host) makes JAX try a
TPU backend at start-up, and on a host without TPU chips it prints warnings about TPU hostnames
before JAX falls back to the CPU. There, with no other accelerator plugin installed, importing the
package asks JAX for the CPU alone: the same backend, without the warnings. A ``JAX_PLATFORMS``
the user set is kept, and so is a backend already started.

The check imports no JAX (a command's ``--help`` needs none): it runs JAX's own test for TPU
chips from its file, and where JAX is not imported yet asks for the CPU through
``JAX_PLATFORMS=cpu``, as a user would, which JAX reads once it is imported. The variable then
stays in the process's environment, and processes it starts inherit it: on this host they would
decide the same (a child bound for a host with TPU chips or a GPU needs an environment of its
own). Imported after JAX, the package sets JAX's config instead and the environment is left as
it was.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import pathlib
import sys

_ACCELERATOR_PLUGINS = ("jax-cuda", "jax_cuda", "jax-rocm", "jax_rocm")


def skip_absent_tpu() -> None:
    """Makes the CPU JAX's only backend when libtpu is installed, the host has no TPU chips
    and no GPU plugin is installed; call before any JAX backend starts."""
    if os.environ.get("JAX_PLATFORMS") or importlib.util.find_spec("libtpu") is None:
        return
    if tpu_chip_count() != 0:  # chips, or jax's test moved: leave the choice to jax
        return
    names = (dist.metadata["Name"] or "" for dist in importlib.metadata.distributions())
    if any(name.startswith(_ACCELERATOR_PLUGINS) for name in names):
        return
    if "jax" in sys.modules:
        sys.modules["jax"].config.update("jax_platforms", "cpu")
    else:
        os.environ["JAX_PLATFORMS"] = "cpu"


def tpu_chip_count() -> int | None:
    """The TPU chips on this host's PCI bus, by jax's own test (``jax._src.hardware_utils``, as
    cloud_tpu_init uses it), run from its file without importing JAX; None where that file
    is gone or no longer runs on its own (another jax version)."""
    jax_spec = importlib.util.find_spec("jax")
    if jax_spec is None or jax_spec.origin is None:
        return None
    path = pathlib.Path(jax_spec.origin).parent / "_src" / "hardware_utils.py"
    if not path.is_file():
        return None
    spec = importlib.util.spec_from_file_location("_jax_hardware_utils", path)
    hardware_utils = importlib.util.module_from_spec(spec)
    try:  # importing the package must not fail on a change in jax's private module
        spec.loader.exec_module(hardware_utils)
        return hardware_utils.num_available_tpu_chips_and_device_id()[0]
    except Exception:
        return None
