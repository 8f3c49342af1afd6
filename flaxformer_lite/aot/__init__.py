"""Ahead-of-time compilation for accelerators this host does not have: a config's train step
(or generation) compiled for a TPU slice from a CPU host, and what it needs per chip.

    topology = parse_topology("v5e-8")
    prepare_host(topology)                       # before JAX starts a backend
    report = analyse(compile_for(cfg, topology), topology)

``flaxformer-lite compile`` (:mod:`flaxformer_lite.cli.compile`) prints the report.
"""

from flaxformer_lite.aot.hlo import COLLECTIVES, collective_counts
from flaxformer_lite.aot.programs import CompiledProgram, abstract_batch, compile_for
from flaxformer_lite.aot.report import Estimate, Report, analyse
from flaxformer_lite.aot.topology import (
    CHIPS,
    Chip,
    Topology,
    TopologyError,
    parse_topology,
    prepare_host,
    topology_devices,
)

__all__ = [
    "CHIPS",
    "COLLECTIVES",
    "Chip",
    "CompiledProgram",
    "Estimate",
    "Report",
    "Topology",
    "TopologyError",
    "abstract_batch",
    "analyse",
    "collective_counts",
    "compile_for",
    "parse_topology",
    "prepare_host",
    "topology_devices",
]
