"""The runs one loop steps together (:func:`.loop.train`), each a :class:`Lane` with its
actions (:class:`LaneActions`), and the two ways one compiled step advances them:
:class:`InTurn`, each lane's state through the step one after another (a run, a lane alone; a
sweep's members on a CPU, whose cores one member's step keeps busy), and :class:`Vmapped`,
their states stacked on a leading member axis through the vmapped step (a sweep's members on
accelerators, where a small model leaves most of a chip idle).

Either way every lane's numbers are arguments of the step (:mod:`.step_numbers`), so a sweep's
member stepped in turn runs the very program, on the very arguments, of its own run.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from flaxformer_lite import parallel
from flaxformer_lite.train.actions import (
    Evaluate,
    EvaluateTasks,
    LogTrain,
    SaveCheckpoint,
    StepEnd,
    nonfinite_error,
    run_actions,
)
from flaxformer_lite.train.config import ConfigError
from flaxformer_lite.train.console import Console
from flaxformer_lite.train.metrics import MetricsWriter
from flaxformer_lite.train.optim import warmup_notice
from flaxformer_lite.train.program import numbered_step, schedule_span, tracing_layout
from flaxformer_lite.train.step import on_leaves
from flaxformer_lite.train.time_spent import TimeSpent


@dataclasses.dataclass
class Lane:
    """A run as the loop steps it.

    Attributes:
      run: the started run (:class:`.loop.StartedRun`).
      name: its name among a sweep's members; None for ``train.py``'s run.
      frozen: what a sweep does with a member whose step is not finite (called with the
        step); None: the run stops (:class:`~.actions.TrainingError`).
      alive: False once the lane is frozen: it steps and logs no further.
      last: the metrics it logged last.

    A lane resumed at a later step than the others waits for them: it takes the steps after
    its own (:meth:`steps_after`).
    """

    run: Any
    name: str | None = None
    frozen: Callable[[int], None] | None = None
    alive: bool = True
    last: dict = dataclasses.field(default_factory=dict)

    def steps_after(self, done: int) -> bool:
        """Whether the lane takes the step after ``done`` steps: alive, and at that step."""
        return self.alive and self.run.step <= done

    def log(self, log: Callable[[str], None]) -> Callable[[str], None]:
        """``log`` with the lane's name before each message (a sweep's member)."""
        if self.name is None:
            return log
        return lambda message: log(f"{self.name}: {message}")


def _sparse_curves_notice(log_every: int, steps: int) -> str | None:
    """A run long enough for a curve that logs too few points to draw one (a recipe's
    ``train.log_every`` kept while its ``train.steps`` were cut)."""
    points = steps // log_every
    if steps < 20 or points >= 3:
        return None
    return (
        f"train.log_every={log_every} logs {points} point(s) of the run's {steps} steps: its "
        f"curves will show little; train.log_every={max(1, steps // 20)} draws 20"
    )


class LaneActions:
    """What the loop keeps of a lane while it steps: its console, metrics writer and actions
    (logging, evaluating with the lanes' one eval step, saving), and what a non-finite step of
    it does."""

    def __init__(
        self, lane: Lane, eval_step, throughput, compiling, progress, log, main: bool, members=1
    ):
        run, total = lane.run, lane.run.cfg.train.steps
        self.lane, self.log = lane, lane.log(log)
        bar = progress and lane.name is None
        self.console = Console(total, run.step, bar=bar, log=self.log, members=members)
        self.writer = (
            MetricsWriter(run.run_dir.path, resume_step=run.step, log=self.log)
            if main
            else NoMetrics()
        )
        self.evaluate = Evaluate(
            run.cfg,
            run.data,
            run.cfg.task,
            eval_step,
            run.built.eval_graphdef,
            run.place,
            self.console,
            compiling,
        )
        scoring = []
        if run.tasks is not None:
            graphdef = run.built.eval_graphdef
            scoring = [EvaluateTasks(run.cfg, run.tasks, run.scorer, graphdef, self.console)]
        self.actions = [
            LogTrain(run.cfg.train.log_every, total, run.numbers["lr"], throughput, self.console),
            self.evaluate,
            *scoring,
            SaveCheckpoint(run.checkpointer, run.cfg, run.base),
        ]
        self.resumed_step = run.step if run.resumed else None
        # The schedule's span: a resumed run keeps the one it was trained with.
        span = schedule_span(run.cfg)
        sparse = _sparse_curves_notice(run.cfg.train.log_every, total)
        for notice in (warmup_notice(run.cfg.optimizer, span), sparse, *run.data.notices):
            if notice:
                self.log(notice)

    def due(self, step: int, final: bool) -> list:
        """The actions due after ``step`` (none once the lane is frozen, nor before the lane
        took a step)."""
        if not self.lane.alive or step <= self.lane.run.step:
            return []
        return [action for action in self.actions if action.due(step, final)]

    def act(self, due: list, end: StepEnd, spent: TimeSpent) -> None:
        run_actions(due, end, self.lane.run.checkpointer, spent)
        if end.values:
            self.writer.write(end.step, end.values)
            self.lane.last = end.values

    def on_nonfinite(self, step: int, metrics: dict) -> None:
        """Step ``step`` was not finite: logged (``train.skip_nonfinite``), the lane frozen
        (a sweep's member), or the run stopped.

        Raises:
          TrainingError: a run's step, naming its last good checkpoint."""
        if not self.lane.alive or step <= self.lane.run.step:  # frozen, or waited
            return
        run = self.lane.run
        if run.cfg.train.skip_nonfinite:
            loss = float(metrics["loss"])
            self.log(
                f"step {step}: the loss or a gradient is not finite (loss {loss}); the update "
                "was skipped"
            )
            return
        if self.lane.frozen is not None:
            self.lane.alive = False
            self.lane.frozen(step)
            return
        raise nonfinite_error(step, float(metrics["loss"]), run.checkpointer, self.resumed_step)

    def close(self) -> None:
        self.writer.close()
        self.console.close()


class NoMetrics:
    """The metrics writer of processes other than 0: they compute the metrics, 0 writes them."""

    def write(self, step: int, values) -> None:
        pass

    def close(self) -> None:
        pass


class InTurn:
    """The lanes stepped one after another by one jitted step (their first lane's), each lane's
    arrays laid out as its run lays them out; its batches placed on the devices by its data's
    prefetch thread, beside the steps. A frozen lane, or one waiting for the others, is not
    stepped."""

    def __init__(self, lanes: list[Lane]):
        first = lanes[0].run
        self.lanes, self.first = lanes, first
        replicated = NamedSharding(first.mesh, PartitionSpec())
        self.numbers = [jax.device_put(lane.run.numbers, replicated) for lane in lanes]
        self._active = jax.device_put(jnp.asarray(True), replicated)
        self._metrics: list = [None] * len(lanes)

    def prefetch(self) -> None:
        for lane in self.lanes:
            lane.run.data.train.place_with(lane.run.place)

    def next_batches(self, done: int) -> list:
        """The batches of the step after ``done`` steps, of the lanes that take it."""
        return [
            next(lane.run.data.train) if lane.steps_after(done) else None for lane in self.lanes
        ]

    def stack(self, leaves: list[list]) -> list[list]:
        return list(leaves)

    def member(self, states: list, index: int) -> list:
        """Lane ``index``'s state leaves."""
        return states[index]

    def member_shapes(self, states: list, index: int) -> list:
        """Lane ``index``'s state leaves' shapes and shardings."""
        return [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) for x in states[index]]

    def member_metrics(self, metrics: list, index: int) -> dict:
        return metrics[index]

    def finite(self, metrics: list) -> list[bool]:
        """Each lane's step was finite (waits for the steps); a lane not stepped was."""
        return [m is None or bool(m["finite"]) for m in metrics]

    def active(self, done: int) -> list:
        return [self._active] * len(self.lanes)

    def compile(self, states, batches, active, log) -> bool:
        """For a sweep's members: compiles the step ahead and checks that every member's state
        fits the devices beside one step; whether it compiled (a run compiles at its first step).

        Raises:
          ConfigError: they need more memory than a device has."""
        if len(self.lanes) == 1:
            return False
        started, first = time.perf_counter(), self.first
        i = next(i for i, batch in enumerate(batches) if batch is not None)  # a lane stepping
        with tracing_layout(first.mesh, first.cfg.mesh.rules):
            lowered = first.train_step.lower(states[i], batches[i], self.numbers[i], active[i])
        compiled = lowered.compile()
        state_bytes = parallel.device_bytes(first.state, first.built.shardings)
        held = step_bytes(compiled) + (len(self.lanes) - 1) * state_bytes
        check_fits(held, len(self.lanes))
        log(
            f"compiled one step for {len(self.lanes)} members, run for each in turn, on mesh "
            f"{parallel.describe_mesh(first.mesh)} in {time.perf_counter() - started:.1f} s: "
            f"{fit_text(held, len(self.lanes))}"
        )
        return True

    def step(self, states: list, batches: list, active: list, done: int):
        """The step after ``done`` steps, of each lane that takes it."""
        step, metrics = self.first.train_step, [None] * len(self.lanes)
        for index, lane in enumerate(self.lanes):
            if lane.steps_after(done):
                states[index], metrics[index], active[index] = step(
                    states[index], batches[index], self.numbers[index], active[index]
                )
        return states, metrics, active


class Vmapped:
    """The lanes as one vmapped step: their states stacked on a leading member axis, on a mesh
    whose ``member`` axis spreads the members over the devices (each device trains its share;
    as many members as divide the runs' ``data`` axis, the rest of it splitting each member's
    batch as in a run), their numbers stacked. The state of a frozen lane, or of one waiting for
    the others (given another's batch), is kept by its flag."""

    def __init__(self, lanes: list[Lane]):
        first = lanes[0].run
        self.lanes, self.first, self.size = lanes, first, len(lanes)
        self.mesh = member_mesh(first.mesh, self.size)
        self.rules = first.cfg.mesh.rules
        self.shardings = [
            NamedSharding(self.mesh, PartitionSpec("member", *s.spec))
            for s in jax.tree.leaves(first.built.shardings)
        ]
        self.member_sharding = NamedSharding(self.mesh, PartitionSpec("member"))
        numbers = [lane.run.numbers for lane in lanes]
        stacked = jax.tree.map(lambda *xs: np.stack(xs), *numbers)
        self.numbers = jax.device_put(stacked, self.member_sharding)
        self._compiled = None

    def prefetch(self) -> None:
        """The members' batches are stacked before they are placed: none placed ahead."""

    def next_batches(self, done: int) -> dict:
        """``{key: [M, B, ...]}`` from each member's batch of this process's rows for the step
        after ``done`` steps (a waiting member's: another's, its own data left untouched)."""
        batches = [
            next(lane.run.data.train) if lane.steps_after(done) else None for lane in self.lanes
        ]
        taken = next((batch for batch in batches if batch is not None), None)
        if taken is None:  # every lane frozen: the loop ends here
            return None
        batches = [taken if batch is None else batch for batch in batches]
        batch_spec = parallel.batch_sharding(self.first.mesh, self.rules).spec
        sharding = NamedSharding(self.mesh, PartitionSpec("member", *batch_spec))
        local = {key: np.stack([batch[key] for batch in batches]) for key in batches[0]}
        rows = self.first.cfg.train.batch_size
        shapes = {key: (self.size, rows, *value.shape[2:]) for key, value in local.items()}
        return jax.make_array_from_process_local_data(sharding, local, shapes)

    def stack(self, leaves: list[list]) -> list:
        """The members' state leaves stacked, on the member mesh; the members' own arrays are
        freed (the stack is their state from here on)."""
        stacked = [jnp.stack(xs) for xs in zip(*leaves, strict=True)]
        stacked = jax.device_put(stacked, self.shardings)
        for x in (x for member in leaves for x in member):
            x.delete()
        return stacked

    def member(self, stacked: list, index: int) -> list:
        """Member ``index``'s state leaves, laid out as its run lays them out."""
        shardings = jax.tree.leaves(self.lanes[index].run.built.shardings)
        return jax.device_put(_member_leaves(stacked, index), shardings)

    def member_shapes(self, stacked: list, index: int) -> list:
        """Member ``index``'s state leaves' shapes and shardings, as its run lays them out."""
        shardings = jax.tree.leaves(self.lanes[index].run.built.shardings)
        return [
            jax.ShapeDtypeStruct(x.shape[1:], x.dtype, sharding=sharding)
            for x, sharding in zip(stacked, shardings, strict=True)
        ]

    def member_metrics(self, metrics: dict, index: int) -> dict:
        return _member_leaves(metrics, index)

    def finite(self, metrics: dict) -> list[bool]:
        return [bool(flag) for flag in np.asarray(metrics["finite"])]

    def active(self, done: int) -> jax.Array:
        flags = np.asarray([lane.run.step <= done for lane in self.lanes])
        return jax.device_put(flags, self.member_sharding)

    def compile(self, stacked, batch, active, log) -> bool:
        """Compiles the step for these arrays, after checking that it fits the devices; True.

        Raises:
          ConfigError: the step needs more memory than a device has."""
        started, first = time.perf_counter(), self.first
        step = on_leaves(numbered_step(first.cfg, first.built.graphdef), first.treedef)
        spread = self.member_sharding
        jitted = jax.jit(
            jax.vmap(step, spmd_axis_name="member"),
            donate_argnums=0,
            out_shardings=(self.shardings, spread, spread),
        )
        with tracing_layout(self.mesh, self.rules):
            compiled = jitted.lower(stacked, batch, self.numbers, active).compile()
        members = self.size // self.mesh.shape["member"]
        check_fits(step_bytes(compiled), members)
        log(
            f"compiled one step for {self.size} members, vmapped, on mesh "
            f"{parallel.describe_mesh(self.mesh)} in {time.perf_counter() - started:.1f} s: "
            f"{fit_text(step_bytes(compiled), members)}"
        )
        self._compiled = compiled
        return True

    def step(self, stacked, batch, active, done: int):
        """The step after ``done`` steps; a member waiting for it joins now (its flag set, the
        others' kept as the devices left them)."""
        joining = np.asarray([lane.run.step == done for lane in self.lanes])
        if joining.any() and done > min(lane.run.step for lane in self.lanes):
            active = active | jax.device_put(joining, self.member_sharding)
        return self._compiled(stacked, batch, self.numbers, active)


@jax.jit
def _member_leaves(stacked, index):
    """Member ``index``'s part of each stacked leaf, in one program: indexed leaf by leaf, each
    leaf's shape would dispatch (and compile) a program of its own."""
    return jax.tree.map(lambda x: x[index], stacked)


def member_mesh(mesh: jax.sharding.Mesh, members: int) -> jax.sharding.Mesh:
    """``mesh`` with a ``member`` axis in front, taken from its ``data`` axis: as many devices
    as the largest divisor of both ``members`` and the ``data`` size (the members spread over
    them), the rest of ``data`` left to each member's batch."""
    data = mesh.shape["data"]
    spread = math.gcd(members, data)
    devices = mesh.devices.reshape(spread, data // spread, *mesh.devices.shape[1:])
    names = ("member", *mesh.axis_names)
    return jax.sharding.Mesh(devices, names, axis_types=(AxisType.Auto,) * len(names))


def fit_text(per_device: int, members: int) -> str:
    return (
        f"{per_device / 2**20:,.1f} MiB per device for {members} member"
        f"{'s' if members > 1 else ''} ({per_device / members / 2**20:,.1f} MiB each)"
    )


def check_fits(per_device: int, members: int) -> None:
    """Raises ConfigError when ``per_device`` bytes are more than a device has."""
    where, limit = parallel.device_memory_limit()
    if limit is not None and per_device > limit:
        raise ConfigError(
            f"the sweep's step needs {fit_text(per_device, members)}; the {where} has "
            f"{limit / 2**20:,.0f} MiB: fewer members per program (vary fewer values), a "
            "smaller train.batch_size, or more devices"
        )


def step_bytes(compiled) -> int:
    """The bytes a device holds while the compiled step runs: its arguments, outputs and
    temporaries, less the donated arguments' bytes the outputs reuse."""
    stats = compiled.memory_analysis()
    if stats is None:
        return 0
    held = stats.argument_size_in_bytes + stats.output_size_in_bytes + stats.temp_size_in_bytes
    return held - stats.alias_size_in_bytes
