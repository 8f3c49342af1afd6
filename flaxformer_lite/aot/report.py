"""What a compiled program needs per chip, and a roofline estimate of its speed.

    report = analyse(program, topology)
    print("\\n".join(report.lines()))
    summary = report.summary()          # the JSON line of ``flaxformer-lite compile``

Memory per chip: parameters and optimizer state from the abstract state's shardings (one
device's shards), XLA's temporaries from ``memory_analysis()``, and the total XLA reserves
(arguments + outputs - donated buffers + temporaries + the program's code).

The estimate is a roofline: the step takes at least as long as its FLOPs at the chip's bf16
peak, its HBM traffic at the chip's bandwidth, and its collectives' bytes through a
bidirectional ring over one mesh axis (:attr:`Chip.ring_bytes_per_s`), whichever is longest,
as if the three overlapped perfectly. It is a floor on the step time (a ceiling on MFU), not
a measurement. XLA's cost analysis counts a loop body once (scanned layers, microbatches): where
the model's own FLOP count (:func:`~flaxformer_lite.models.training_flops_per_token`) is larger,
the FLOPs and HBM traffic are scaled up by that ratio.
"""

from __future__ import annotations

import dataclasses
import math
import re

from flaxformer_lite import parallel
from flaxformer_lite.aot.hlo import COLLECTIVES, collective_counts
from flaxformer_lite.aot.programs import CompiledProgram
from flaxformer_lite.aot.topology import GIB, Topology

_SIZE = re.compile(r"\(([\d.]+)([KMGT])\)")  # "(112.01G)" in the compiler's message


@dataclasses.dataclass(frozen=True)
class Estimate:
    """The roofline's times in seconds per run of the program, and the MFU they imply."""

    compute_seconds: float
    memory_seconds: float
    network_seconds: float
    step_seconds: float
    mfu: float

    def lines(self) -> list[str]:
        """The estimate, what bounds it and what it assumes: a compute-bound step reads MFU
        100% by construction (its time is its FLOPs at peak), which no measured step reaches."""
        times = {
            "compute (the FLOPs at the chip's bf16 peak)": self.compute_seconds,
            "HBM (the traffic at the chip's bandwidth)": self.memory_seconds,
            "interconnect (the collectives' bytes over a ring)": self.network_seconds,
        }
        bound = max(times, key=times.get)
        return [
            f"estimate (roofline, not a measurement): at least {self.step_seconds * 1e3:.3g} ms "
            f"per step, MFU at most {self.mfu:.1%}; bound by {bound}",
            f"  compute {self.compute_seconds * 1e3:.3g} ms, HBM {self.memory_seconds * 1e3:.3g} "
            f"ms, interconnect {self.network_seconds * 1e3:.3g} ms, assumed fully overlapped, "
            "with no kernel, launch or pipeline overhead",
        ]


@dataclasses.dataclass(frozen=True)
class Report:
    """A compiled program per chip; byte counts are one chip's."""

    topology: Topology
    program: str
    mesh: dict[str, int]
    attention: str
    params: int
    optimizer: int
    temp: int
    total: int
    hbm: int | None
    xla_flops: float | None
    model_flops: float
    optimizer_flops: float
    hbm_traffic: float | None
    collectives: dict[str, dict] | None
    estimate: Estimate | None
    compiler_message: str | None = None

    @property
    def fits(self) -> bool | None:
        """Whether the total fits the chip's HBM (None for simulated CPU devices)."""
        if self.compiler_message:
            return False
        return None if self.hbm is None else self.total <= self.hbm

    def summary(self) -> dict:
        """The JSON object of the report's last line."""
        estimate = self.estimate
        return {
            "topology": self.topology.name,
            "chips": self.topology.chips,
            "mesh": self.mesh,
            "per_chip_bytes": {
                "params": self.params,
                "optimizer": self.optimizer,
                "temp": self.temp,
                "total": self.total,
            },
            "hbm_bytes": self.hbm,
            "fits": self.fits,
            # per chip and executed step, the model's count (as MFU's): the same scanned or not
            "flops_per_step": self.model_flops / self.topology.chips,
            # XLA's cost analysis of the program, per chip: a loop's body counted once (None
            # from the GPU compiler)
            "xla_flops_per_program": self.xla_flops or None,
            # per chip and step, Muon's Newton-Schulz (0 for AdamW): in XLA's count, not the model's
            "optimizer_flops_per_step": self.optimizer_flops,
            "collectives": self.collectives
            and {op: self.collectives[op]["executed"] for op in COLLECTIVES},
            # False: a loop of unknown length holds some, counted once (a lower bound)
            "collectives_exact": self.collectives
            and all(self.collectives[op]["exact"] for op in COLLECTIVES),
            "attention": self.attention,
            "estimated_step_seconds": estimate and estimate.step_seconds,
            "estimated_mfu": estimate and estimate.mfu,
        }

    def lines(self) -> list[str]:
        """The human-readable report, one line each."""
        chips, chip = self.topology.chips, self.topology.chip
        kind = "TPU " if self.topology.platform == "tpu" else ""
        where = f"{chips} x {kind}{chip.name}" if chip else f"{chips} CPU devices"
        mesh = " x ".join(f"{axis} {size}" for axis, size in self.mesh.items())
        lines = [
            f"{self.program} for {self.topology.name} ({where}), mesh {mesh}",
            f"attention: {self.attention}",
            "per chip:",
            f"  parameters       {_gib(self.params)}",
            f"  optimizer state  {_gib(self.optimizer)}",
            f"  temporaries      {_gib(self.temp)}",
            f"  total            {_gib(self.total)}"
            + (f" of {_gib(self.hbm)} HBM ({self.total / self.hbm:.0%})" if self.hbm else ""),
        ]
        if self.compiler_message:
            return [*lines, f"the TPU compiler refused the program: {self.compiler_message}"]
        model_flops = self.model_flops / chips
        lines.append(
            f"FLOPs per step per chip: {self.xla_flops:.4g} (XLA's count), {model_flops:.4g} "
            "(the model's own count)"
            + (
                f" + {self.optimizer_flops:.4g} (Muon's Newton-Schulz, the chip's share)"
                if self.optimizer_flops
                else ""
            )
        )
        looped = self.xla_flops - self.optimizer_flops  # the model's part of XLA's count
        if looped > 0 and model_flops > 1.5 * looped:
            aside = " (Newton-Schulz's aside)" if self.optimizer_flops else ""
            lines.append(
                f"  XLA's count{aside} is {model_flops / looped:.3g}x lower: it counts a loop's "
                "body once (scanned layers, microbatches, a blockwise loss); the estimate "
                "uses the model's"
            )
        lines.append("collectives per step (bytes one chip sends, as a ring moves them):")
        for op in COLLECTIVES:
            counts = self.collectives[op]
            if counts["instructions"]:
                loops = "" if counts["exact"] else " (a loop of unknown length counted once)"
                lines.append(f"  {op:<19}{counts['executed']:>6} x, {_gib(counts['bytes'])}{loops}")
        if not any(self.collectives[op]["instructions"] for op in COLLECTIVES):
            lines.append("  none")
        if self.topology.platform == "tpu" and self.collectives["collective-permute"]["executed"]:
            lines.append(
                "  (the TPU compiler decomposes FSDP's all-gathers and reduce-scatters, and "
                "rings of other collectives, into collective-permutes: they count there)"
            )
        if self.estimate:
            lines += self.estimate.lines()
        return lines


def analyse(program: CompiledProgram, topology: Topology) -> Report:
    """The report of ``program`` compiled for ``topology``."""
    if program.compiled is None:
        return _out_of_memory(program, topology)
    compiled = program.compiled
    memory = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = (cost[0] if isinstance(cost, list) else cost) or {}  # none from the GPU compiler
    total = (
        memory.argument_size_in_bytes
        + memory.output_size_in_bytes
        - memory.alias_size_in_bytes
        + memory.temp_size_in_bytes
        + memory.generated_code_size_in_bytes
    )
    collectives = collective_counts(compiled.as_text(), topology.chips)
    xla_flops = float(cost.get("flops", 0.0))
    traffic = float(cost.get("bytes accessed", 0.0))
    chip = topology.chip
    estimate = None
    if chip is not None:
        estimate = _roofline(
            chip_flops=program.model_flops / topology.chips,
            optimizer_flops=program.optimizer_flops,
            xla_flops=xla_flops,
            traffic=max(traffic, program.weight_reads * program.param_bytes),
            sent=sum(collectives[op]["bytes"] for op in COLLECTIVES),
            chip=chip,
        )
    return Report(
        topology=topology,
        program=program.name,
        mesh=parallel.mesh_sizes(program.mesh),
        attention=program.attention,
        params=program.param_bytes,
        optimizer=program.optimizer_bytes,
        temp=memory.temp_size_in_bytes,
        total=total,
        hbm=chip.hbm_bytes if chip else None,
        xla_flops=xla_flops,
        model_flops=program.model_flops,
        optimizer_flops=program.optimizer_flops,
        hbm_traffic=traffic,
        collectives=collectives,
        estimate=estimate,
    )


def _out_of_memory(program: CompiledProgram, topology: Topology) -> Report:
    """The report of a program the compiler refused: the state's bytes, and the compiler's
    count of what the rest needs (its temporaries, or the program)."""
    message = program.out_of_memory
    size = _SIZE.search(message)
    needed = float(size.group(1)) * 1024 ** " KMGT".index(size.group(2)) if size else 0.0
    state = program.param_bytes + program.optimizer_bytes
    temp = int(needed) if "temporaries" in message else max(int(needed) - state, 0)
    return Report(
        topology=topology,
        program=program.name,
        mesh=parallel.mesh_sizes(program.mesh),
        attention=program.attention,
        params=program.param_bytes,
        optimizer=program.optimizer_bytes,
        temp=temp,
        total=state + temp,
        hbm=topology.chip.hbm_bytes,
        xla_flops=None,
        model_flops=program.model_flops,
        optimizer_flops=program.optimizer_flops,
        hbm_traffic=None,
        collectives=None,
        estimate=None,
        compiler_message=message,
    )


def _roofline(*, chip_flops, optimizer_flops, xla_flops, traffic, sent, chip) -> Estimate:
    """The roofline of a step of the model's ``chip_flops`` and the optimizer's: XLA's count
    less the optimizer's, against the model's, says how often a loop's body runs. MFU counts
    the model's FLOPs only (as PaLM's)."""
    looped = xla_flops - optimizer_flops
    loops = max(1.0, chip_flops / looped) if looped > 0 else 1.0
    compute = max(chip_flops + optimizer_flops, xla_flops) / chip.peak_flops
    memory = traffic * loops / chip.hbm_bytes_per_s
    network = sent / chip.ring_bytes_per_s
    step = max(compute, memory, network)
    mfu = chip_flops / (step * chip.peak_flops) if step > 0 else math.nan
    return Estimate(compute, memory, network, step, mfu)


def _gib(num_bytes: float) -> str:
    """``"1.50 GiB"``, or MiB below one GiB."""
    if num_bytes >= GIB:
        return f"{num_bytes / GIB:.2f} GiB"
    return f"{num_bytes / 2**20:.2f} MiB"
