"""Accelerators to compile for without having them: the chips' figures and the slices' names.

    slice_ = parse_topology("v5e-8")      # 8 TPU v5e chips, topology "v5e:2x4"
    devices = topology_devices(slice_)    # compile-only TPU devices (needs libtpu)
    parse_topology("cpu-4")               # 4 simulated CPU devices of this process
    parse_topology("h100-8")              # 8 NVIDIA H100s, one host (needs jax's CUDA plugin)

Names follow MaxText's accelerator types: ``v5e-N`` and ``v6e-N`` count chips, ``v4-N`` and
``v5p-N`` count TensorCores (two per chip, one "megacore" device each), so ``v5p-8`` is 4 chips.
An explicit ``v5e:2x4`` (libtpu's own topology name) is accepted too. Chip counts that are
powers of two get MaxText's shapes (``v5e-256`` is ``16x16``, ``v5p-128`` is ``4x4x4``).

``h100-N`` compiles for N H100s (8 per host) through jax's CUDA plugin, given XLA's description
of the GPU (:data:`H100_TARGET_CONFIG`) instead of a GPU: the plugin and cuDNN are installed
with the ``gpu-compile`` extra, and the host's JAX must start on the CPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import sys
import tempfile

GIB = 2**30


@dataclasses.dataclass(frozen=True)
class Chip:
    """One accelerator chip: what the roofline estimate divides by.

    Attributes:
      name: the chip's short name (``v5e``).
      hbm_bytes: memory per chip.
      peak_flops: dense bf16 matmul FLOP/s per chip.
      hbm_bytes_per_s: memory bandwidth per chip.
      ici_bytes_per_s: bidirectional inter-chip bandwidth per chip, all ports together.
      ici_ports: the chip's inter-chip links; a ring over one mesh axis uses two of them.
      source: where the figures come from.
    """

    name: str
    hbm_bytes: int
    peak_flops: float
    hbm_bytes_per_s: float
    ici_bytes_per_s: float
    ici_ports: int
    source: str

    @property
    def ring_bytes_per_s(self) -> float:
        """What one chip sends per second in a bidirectional ring over one mesh axis: both
        directions of two of its links."""
        return self.ici_bytes_per_s * 2 / self.ici_ports


_CLOUD_TPU = "https://cloud.google.com/tpu/docs/"
CHIPS: dict[str, Chip] = {
    "v4": Chip(
        "v4",
        32 * GIB,
        275e12,
        1200e9,
        540e9,
        6,
        _CLOUD_TPU + "v4 (ICI: jax-ml.github.io/scaling-book/tpus, 4.5e10 B/s one way a link)",
    ),
    "v5e": Chip("v5e", 16 * GIB, 197e12, 819e9, 400e9, 4, _CLOUD_TPU + "v5e"),
    "v5p": Chip("v5p", 95 * GIB, 459e12, 2765e9, 1200e9, 6, _CLOUD_TPU + "v5p"),
    "v6e": Chip("v6e", 32 * GIB, 918e12, 1638e9, 800e9, 4, _CLOUD_TPU + "v6e"),
    # NVLink 4 through NVSwitch: 900 GB/s both ways a GPU; a ring's two neighbours share it.
    "h100": Chip(
        "h100",
        80 * GIB,
        989e12,
        3350e9,
        900e9,
        2,
        "https://www.nvidia.com/en-us/data-center/h100/ (SXM: dense bf16, HBM3, NVLink)",
    ),
}

# An H100 as XLA's GPU compiler sees it (its TargetConfig): enough to compile without a GPU.
H100_TARGET_CONFIG = """
gpu_device_info {
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: 132
  fpus_per_core: 128 block_dim_limit_x: 2147483647 block_dim_limit_y: 65535
  block_dim_limit_z: 65535 memory_bandwidth: 3352320000000 l2_cache_size: 52428800
  clock_rate_ghz: 1.98 device_memory_size: 84929347584 shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 } registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 8 }
runtime_version { major: 12 minor: 8 }
device_description_str: "NVIDIA H100 80GB HBM3"
"""
_GPUS_PER_HOST = 8

# libtpu's name of each chip's topologies, its chip configuration, and the axes of its torus.
_TPU_FAMILIES = {
    "v4": ("v4", "megacore", 3),
    "v5p": ("v5", "megacore", 3),
    "v5e": ("v5e", "default", 2),
    "v6e": ("v6e", "default", 2),
}
_CORES_PER_DEVICE = {"v4": 2, "v5p": 2, "v5e": 1, "v6e": 1}
_HOST_BOUNDS = (2, 2, 1)  # chips per host, as MaxText compiles every slice


@dataclasses.dataclass(frozen=True)
class Topology:
    """A slice to compile for: ``platform`` ``"tpu"`` or ``"cpu"``, its ``chips``, the ``chip``
    (None for simulated CPU devices) and, for a TPU, libtpu's ``shape`` of the slice."""

    name: str
    platform: str
    chips: int
    chip: Chip | None = None
    shape: tuple[int, ...] = ()

    @property
    def libtpu_name(self) -> str:
        """``"v5e:2x4"``: the name ``jax.experimental.topologies`` takes."""
        return f"{_TPU_FAMILIES[self.chip.name][0]}:{'x'.join(map(str, self.shape))}"


class TopologyError(ValueError):
    """An unknown topology name, or one this host cannot compile for; the message says why."""


def parse_topology(name: str) -> Topology:
    """The slice ``name`` stands for (see the module docstring).

    Raises:
      TopologyError: an unknown family, a size that is not a positive power of two (of whole
        chips), or a malformed explicit shape; the message lists the accepted forms.
    """
    text = name.strip().lower()
    if match := re.fullmatch(r"cpu-(\d+)", text):
        count = int(match.group(1))
        if count < 1:
            raise TopologyError(f"--topology {name}: needs at least one CPU device")
        return Topology(name, "cpu", count)
    if match := re.fullmatch(r"h100-(\d+)", text):
        gpus = int(match.group(1))
        hosts, rest = divmod(gpus, _GPUS_PER_HOST)
        if gpus < 1 or (gpus > _GPUS_PER_HOST and rest):
            raise TopologyError(
                f"--topology {name}: h100-N takes N from 1 to {_GPUS_PER_HOST} (one host) or "
                f"a multiple of {_GPUS_PER_HOST} (whole hosts)"
            )
        shape = (1, max(hosts, 1), min(gpus, _GPUS_PER_HOST))  # slices x hosts x GPUs a host
        return Topology(name, "cuda", gpus, CHIPS["h100"], shape)
    if match := re.fullmatch(r"(v4|v5p|v5e|v6e)-(\d+)", text):
        family, cores = match.group(1), int(match.group(2))
        per_device = _CORES_PER_DEVICE[family]
        chips, rest = divmod(cores, per_device)
        if rest or chips < 1 or chips & (chips - 1):
            raise TopologyError(
                f"--topology {name}: {family}-N takes N = {per_device} x a power of two "
                f"(cores{' of two per chip' if per_device == 2 else ''}); for other shapes "
                f"give libtpu's name, e.g. {_TPU_FAMILIES[family][0]}:4x4x12"
            )
        shape = _slice_shape(chips, _TPU_FAMILIES[family][2])
        return Topology(name, "tpu", chips, CHIPS[family], shape)
    if match := re.fullmatch(r"(v4|v5p?|v5e|v6e):(\d+(?:x\d+){1,2})", text):
        family = {"v5": "v5p"}.get(match.group(1), match.group(1))
        shape = tuple(int(size) for size in match.group(2).split("x"))
        if len(shape) != _TPU_FAMILIES[family][2] or min(shape) < 1:
            axes = _TPU_FAMILIES[family][2]
            raise TopologyError(f"--topology {name}: a {family} slice has {axes} positive sizes")
        chips = 1
        for size in shape:
            chips *= size
        return Topology(name, "tpu", chips, CHIPS[family], shape)
    raise TopologyError(
        f"unknown --topology {name!r}: use v4-N, v5p-N, v5e-N or v6e-N (MaxText's names, e.g. "
        "v5e-8, v5p-128), libtpu's names (v5e:2x4), h100-N, or cpu-N for N simulated CPU "
        "devices"
    )


def _slice_shape(chips: int, axes: int) -> tuple[int, ...]:
    """MaxText's slice shapes: from ``1x1`` (or ``2x2x1`` for 3-D tori) double the last of
    the smallest sizes until there are ``chips``."""
    shape = [1, 1] if axes == 2 else [2, 2, 1] if chips >= 4 else [1, 1, 1]
    while _product(shape) < chips:
        smallest = min(shape)
        shape[max(i for i, size in enumerate(shape) if size == smallest)] *= 2
    return tuple(shape)


def _product(sizes) -> int:
    total = 1
    for size in sizes:
        total *= size
    return total


def topology_devices(topology: Topology) -> list:
    """The devices of ``topology``: compile-only TPU devices from libtpu, or the first
    ``chips`` CPU devices of this process.

    Raises:
      TopologyError: libtpu is not installed (the message says what to install), or this
        process has fewer CPU devices than ``cpu-N`` asks for.
    """
    import jax

    if topology.platform == "cpu":
        devices = jax.devices("cpu")
        if len(devices) < topology.chips:
            raise TopologyError(
                f"--topology {topology.name}: this process has {len(devices)} CPU devices; "
                "the device count is fixed when JAX starts (flaxformer-lite compile sets it "
                "before then)"
            )
        return devices[: topology.chips]
    from jax.experimental import topologies

    if topology.platform == "cuda":
        return _gpu_devices(topology)

    if not _libtpu_installed():
        raise TopologyError(
            f"--topology {topology.name} compiles with libtpu, which is not installed: "
            f'pip install "jax[tpu]=={jax.__version__}" (or pip install -e ".[tpu]")'
        )
    bounds = tuple(min(b, s) for b, s in zip(_HOST_BOUNDS, (*topology.shape, 1), strict=False))
    family, chip_config, _ = _TPU_FAMILIES[topology.chip.name]
    # libtpu warns on stderr that this host is no TPU VM; shown only if it then fails.
    with _stderr_kept_on_error():
        description = topologies.get_topology_desc(
            platform="tpu",
            topology_name=topology.libtpu_name,
            chip_config_name=chip_config,
            chips_per_host_bounds=bounds,
            num_slices=1,
        )
    return list(description.devices)


def _gpu_devices(topology: Topology) -> list:
    """Compile-only H100s from jax's CUDA plugin and :data:`H100_TARGET_CONFIG`."""
    import importlib.util

    import jax
    from jax.experimental import topologies

    install = (
        f'pip install "jax-cuda12-plugin=={jax.__version__}" "jax-cuda12-pjrt=={jax.__version__}" '
        '"nvidia-cudnn-cu12>=9.8,<10" (or pip install -e ".[gpu-compile]")'
    )
    try:
        plugin = importlib.util.find_spec("jax_plugins.xla_cuda12")
    except ModuleNotFoundError:  # no plugin of any kind: find_spec imports jax_plugins first
        plugin = None
    if plugin is None:
        raise TopologyError(
            f"--topology {topology.name} compiles with jax's CUDA plugin, which is not "
            f"installed: {install}"
        )
    try:
        description = topologies.get_topology_desc(
            platform="cuda",
            target_config=H100_TARGET_CONFIG,
            topology="x".join(map(str, topology.shape)),
        )
    except NotImplementedError as error:  # the plugin did not register: JAX started a GPU
        raise TopologyError(
            f"--topology {topology.name}: jax's CUDA plugin is not available ({error}); start "
            "with JAX_PLATFORMS=cpu so that it registers without a GPU"
        ) from None
    return list(description.devices)


def _libtpu_installed() -> bool:
    from jax._src import cloud_tpu_init

    return cloud_tpu_init.get_tpu_library_path() is not None


@contextlib.contextmanager
def _stderr_kept_on_error():
    """Holds back what is written to file descriptor 2 (C++ logging included) and passes it
    on only if the block raises."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as capture:
        os.dup2(capture.fileno(), 2)
        try:
            yield
        except BaseException:
            os.dup2(saved, 2)
            capture.seek(0)
            sys.stderr.write(capture.read().decode(errors="replace"))
            raise
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def prepare_host(topology: Topology) -> None:
    """Settings that must precede JAX's first use of a backend: ``cpu-N``'s device count, and
    the CPU as the host's backend (the compile needs no local accelerator, and a TPU VM's
    chips stay free for a running job). A ``JAX_PLATFORMS`` the user set is kept. The backend
    settings have no effect once a backend has started."""
    import jax
    from jax._src import xla_bridge

    if not xla_bridge.backends_are_initialized():
        if topology.platform == "cpu":
            jax.config.update("jax_num_cpu_devices", topology.chips)
        if not os.environ.get("JAX_PLATFORMS"):
            jax.config.update("jax_platforms", "cpu")
    if "tpu" not in (jax.config.jax_platforms or ""):
        # libtpu holds a lock file for the process that drives the local TPU; a compile-only
        # topology drives none, so compiles in several processes may load it at once.
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
