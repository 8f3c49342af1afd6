"""A sweep: the members of :mod:`.sweep_members` trained in one command, those that share a
program advanced by one compiled step: vmapped over their states stacked on a member axis (on
accelerators), or run for each member in turn (on a CPU).

    summary = sweep(load_config(None, ["run_dir=runs/seeds", "train.steps=200"]),
                    {"seed": [0, 1, 2], "optimizer.lr": [1e-3, 3e-3]})
    summary["groups"]["lr=0.001"]["eval_loss"]  # {"mean": ..., "std": ..., "n": 3, ...}

Each member is a run (``<run_dir>/<member>``: config.yaml, metrics.jsonl, tb/, checkpoints,
tokenizer), started by :func:`.loop.start` as ``train.py`` starts one, so everything that
reads a run reads a member. A group's members step in lockstep, each on its own batches, their
numbers (the learning rate by step, Adam's betas and epsilon, weight decay, clipping, label
smoothing, z-loss) passed to the step as arrays. A member whose step is not finite is
frozen in the program at its last finite state and trains no further; the others go on.
``<run_dir>/sweep.json`` records the sweep (its members, the diverged ones) and, at the end, the
summary (:mod:`.sweep_summary`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import pathlib
import time
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from flaxformer_lite import parallel
from flaxformer_lite.models import training_flops_per_token
from flaxformer_lite.models.pieces import check_pieces, trusted_code
from flaxformer_lite.train.actions import (
    Evaluate,
    LogTrain,
    SaveCheckpoint,
    StepEnd,
    Throughput,
    quiet,
    run_actions,
)
from flaxformer_lite.train.compilation_cache import use_compilation_cache
from flaxformer_lite.train.config import (
    ConfigError,
    TrainConfig,
    config_diff,
    config_from_dict,
    flatten,
    is_runtime_key,
)
from flaxformer_lite.train.console import Console
from flaxformer_lite.train.loop import NoMetrics, StartedRun, start
from flaxformer_lite.train.metrics import MetricsWriter, peak_flops
from flaxformer_lite.train.optim import NUMBERS, optimizer_of, schedule_table, table_schedule
from flaxformer_lite.train.program import (
    abstract_batch,
    build_train_state,
    resolve_mesh,
    tracing_layout,
)
from flaxformer_lite.train.resume import restore_data_state
from flaxformer_lite.train.run_dir import RunDir, move_aside
from flaxformer_lite.train.signals import Interrupted, SignalAgreement, stop_on_signals
from flaxformer_lite.train.step import make_eval_step, task_of, train_step
from flaxformer_lite.train.sweep_members import (
    LOSS_NUMBERS,
    PER_MEMBER,
    Member,
    numbers_aside,
    split_settings,
    sweep_members,
)
from flaxformer_lite.train.sweep_summary import summarize, summary_table
from flaxformer_lite.train.trained_run import from_savable, restore_target

SWEEP_FILE = "sweep.json"


def sweep(
    cfg: TrainConfig,
    vary: Mapping[str, Sequence[Any]],
    *,
    fresh: bool = False,
    force: bool = False,
    vmap: bool | None = None,
    trust_code: bool = False,
    log=print,
) -> dict:
    """Trains every member of the sweep of ``cfg`` over ``vary`` in ``cfg.run_dir/<member>``,
    resuming them from their checkpoints; returns the summary (also in ``cfg.run_dir/sweep.json``).

    >>> from flaxformer_lite.train.config import load_config
    >>> cfg = load_config(None, ["run_dir=runs/seeds", "train.steps=300"])
    >>> summary = sweep(cfg, {"seed": [0, 1, 2, 3]})  # doctest: +SKIP
    >>> summary["groups"]["all"]["eval_loss"]["mean"]  # doctest: +SKIP

    Args:
      cfg: the settings every member starts from (its ``run_dir`` is the sweep's directory).
      vary: dotted keys and the values each takes; the members are their product.
      fresh: move an existing sweep directory aside first.
      force: resume members whose settings changed (as ``train.py --force``).
      vmap: step a group's members as one vmapped step (True) or by one compiled step in turn
        (False); None: vmapped on accelerators, in turn on a CPU (docs/design.md, "Sweeps").
      trust_code: import the code the settings name by import path (``models.pieces``).
      log: where one-line messages go.

    Raises:
      ConfigError: a bad varied key or value, a directory that holds a run or another sweep,
        and what ``train.py`` refuses of a member.
    """
    with trusted_code(trust_code):
        return _sweep(cfg, vary, fresh=fresh, force=force, vmap=vmap, log=log)


def _sweep(cfg: TrainConfig, vary, *, fresh: bool, force: bool, vmap: bool | None, log) -> dict:
    """:func:`sweep`, the code it names trusted or not."""
    use_compilation_cache(cfg.train.compilation_cache)
    members = sweep_members(cfg, vary)
    for member in members:  # code named by import path, imported (if trusted) and traced
        check_pieces(member.cfg.model)
    parallel.initialize(cfg.distributed)
    main = jax.process_index() == 0
    log = log if main else quiet  # every process trains, process 0 reports and writes
    groups = _groups(members)  # bad settings are refused before anything is written
    directory = pathlib.Path(cfg.run_dir)
    record = {"vary": {k: [_plain(v) for v in values] for k, values in vary.items()}}
    record["config"] = dataclasses.replace(cfg, run_dir="").to_dict()
    record["members"] = {m.name: {k: _plain(v) for k, v in m.settings.items()} for m in members}
    diverged = _open_directory(directory, record, fresh=fresh and main, force=force, log=log)
    groups = [kept for group in groups if (kept := [m for m in group if m.name not in diverged])]
    _announce(members, groups, diverged, log)
    with contextlib.ExitStack() as stack:
        for member in members:
            if main and member.name not in diverged:
                stack.enter_context(RunDir(member.cfg.run_dir).locked(log=log))
        for group in groups:
            _train_group(group, directory, record, diverged, force=force, vmap=vmap, log=log)
    summary = summarize(directory, members, diverged)
    _write_json(directory / SWEEP_FILE, record | {"diverged": diverged, "summary": summary})
    log(summary_table(summary))
    return summary


def _open_directory(directory: pathlib.Path, record: dict, *, fresh: bool, force: bool, log):
    """Checks ``directory`` for this sweep (new, empty, or the same sweep's), moves it aside
    with ``fresh``, records the sweep; returns its diverged members ``{name: step}``.

    Raises:
      ConfigError: a file, a run, a directory of other files, or another sweep.
      RunDirLinkError: symbolic links in it, which the sweep's writes would follow."""
    if directory.exists() and not directory.is_dir():
        raise ConfigError(f"run_dir {directory} is a file, not a sweep directory")
    if directory.is_dir():
        RunDir(directory).refuse_links()
    if RunDir(directory).is_run():
        raise ConfigError(
            f"run_dir {directory} holds a run (train.py's), not a sweep: choose another run_dir"
        )
    path = directory / SWEEP_FILE
    held = sorted(p.name for p in directory.iterdir()) if directory.is_dir() else []
    held = [name for name in held if name != "library.log"]  # the command's, written first
    if held and not path.exists():
        held = ", ".join(held[:5])
        raise ConfigError(
            f"run_dir {directory} is not a sweep directory: it holds {held} and no {SWEEP_FILE}; "
            "choose a new or empty run_dir"
        )
    if fresh and path.exists():
        log(f"--fresh: moved the previous sweep to {move_aside(directory)}")
    diverged = {}
    if path.exists():
        old = _read_json(path)
        _check_same_sweep(directory, old, record, force)
        diverged = dict(old.get("diverged", {}))
    if jax.process_index() == 0:
        directory.mkdir(parents=True, exist_ok=True)
    _write_json(path, record | {"diverged": diverged})
    return diverged


def _check_same_sweep(directory: pathlib.Path, old: dict, new: dict, force: bool) -> None:
    """Raises ConfigError listing what differs between the sweep in ``directory`` and this one:
    other members always, other settings unless ``force`` (train.py's runtime keys may change)."""
    problems = []
    if old.get("members") != new["members"]:
        gone = sorted(set(old.get("members", {})) - set(new["members"]))
        added = sorted(set(new["members"]) - set(old.get("members", {})))
        problems.append(f"members not in this sweep {gone}, members new in it {added}")
    changed = config_diff(config_from_dict(old["config"]), config_from_dict(new["config"]))
    changed = {k: v for k, v in changed.items() if not is_runtime_key(k)}
    if changed and not force:
        problems += [f"{key}: {a!r} -> {b!r}" for key, (a, b) in changed.items()]
    if problems:
        raise ConfigError(
            f"run_dir {directory} holds another sweep: " + "; ".join(problems) + " (pass --fresh "
            "to move it aside, or choose another run_dir"
            + ("" if force else "; --force takes changed settings")
            + ")"
        )


def _groups(members: list[Member]) -> list[list[Member]]:
    """The members by program: those whose :func:`program_key` is equal, in the sweep's order."""
    groups: list[tuple[tuple, list[Member]]] = []
    traced: dict[str, tuple] = {}  # one trace for the members that differ only in numbers
    for member in members:
        aside = numbers_aside(member.cfg)
        if aside not in traced:
            traced[aside] = program_key(member.cfg)
        key = traced[aside]
        same = next((group for known, group in groups if known == key), None)
        if same is None:
            groups.append((key, [member]))
        else:
            same.append(member)
    return [group for _, group in groups]


def _announce(members, groups, diverged, log) -> None:
    splits = split_settings(members, groups)
    why = f", split by {', '.join(splits)}" if splits else ""
    sizes = " + ".join(str(len(group)) for group in groups)
    log(
        f"sweep: {len(members)} members, {len(groups)} compiled program"
        f"{'s' if len(groups) != 1 else ''} ({sizes} members{why})"
    )
    for name, step in diverged.items():
        log(f"{name}: diverged at step {step} in an earlier session; not trained")


@dataclasses.dataclass
class _Lane:
    """A member in its group's program: its started run, and while it steps, what it writes
    and the actions due at its steps."""

    member: Member
    run: StartedRun
    writer: Any = None
    console: Console | None = None
    actions: list = dataclasses.field(default_factory=list)


def _train_group(group: list[Member], directory, record, diverged, *, force: bool, vmap, log):
    """Prepares the group's members as runs, stacks them, and steps them to ``train.steps``."""
    lanes: list[_Lane] = []
    try:
        for member in group:
            say = _prefixed(member.name, log)
            lanes.append(
                _Lane(member, start(member.cfg, RunDir(member.cfg.run_dir), force=force, log=say))
            )
        _align_steps(lanes, log)
        if vmap is None:
            vmap = lanes[0].run.mesh.devices.flat[0].platform != "cpu"
        _step_group(lanes, directory, record, diverged, vmap=vmap, log=log)
    finally:
        for lane in lanes:
            if lane.writer is not None:
                lane.writer.close()
            lane.run.checkpointer.close()
            lane.run.data.train.close()


def _align_steps(lanes: list[_Lane], log) -> None:
    """Restores the members that are ahead (a sweep stopped while some members' saves were in
    flight) to the newest step every member has a checkpoint of, so that they step together.

    Raises:
      ConfigError: a member with no checkpoint beside members with some."""
    common = min(lane.run.step for lane in lanes)
    for lane in lanes:
        run = lane.run
        if run.step == common:
            continue
        if common == 0:
            raise ConfigError(
                f"{run.run_dir} is at step {run.step}, other members have no checkpoint: pass "
                "--fresh to move the sweep aside and start over"
            )
        restored = run.checkpointer.restore(restore_target(run.state), step=common)
        restore_data_state(run.data.train, restored.data_state, False, log)
        state = from_savable(restored.state, run.state)
        log(f"{lane.member.name}: back to step {common}, the step every member reached")
        lane.run = dataclasses.replace(run, state=state, step=common)


def _step_group(lanes: list[_Lane], directory, record, diverged: dict, *, vmap: bool, log):
    """The group's steps, one compiled program for every member (vmapped, or in turn), and each
    member's actions at the steps they are due (as :func:`.loop.train`), under its run's mesh."""
    first = lanes[0].run
    cfg, step, total = first.cfg, first.step, first.cfg.train.steps
    task = task_of(cfg.model)
    program = (_VmappedProgram if vmap else _LoopProgram)(lanes)
    eval_step = make_eval_step(
        first.built.eval_graphdef, task=task, loss_chunk=cfg.train.loss_chunk
    )
    flops_per_token = training_flops_per_token(cfg.model, cfg.data.seq_len)
    tokens_per_step = cfg.train.batch_size * cfg.data.seq_len
    throughput = Throughput(tokens_per_step, flops_per_token, peak_flops(), log)
    rates = _StepRates()
    stacked = program.stack([lane.run.state for lane in lanes])
    active = program.active()
    batch = program.place([next(lane.run.data.train) for lane in lanes]) if step < total else None
    if step < total:
        step_fn = program.compiled(stacked, batch, active, log)
    main = jax.process_index() == 0
    for lane in lanes:
        run, say = lane.run, _prefixed(lane.member.name, log)
        lane.writer = (
            MetricsWriter(run.run_dir.path, resume_step=run.step, log=say) if main else NoMetrics()
        )
        lane.console = Console(total, step, bar=False, log=say)
        lane.actions = [
            LogTrain(cfg.train.log_every, total, run.built.schedule, rates, lane.console),
            Evaluate(
                run.cfg, run.data, task, eval_step, run.built.eval_graphdef, run.place, lane.console
            ),
            SaveCheckpoint(run.checkpointer, run.cfg),
        ]
    alive = [True] * len(lanes)
    pending = None  # (step, the members' flags after it), read one step late
    agree = SignalAgreement()
    throughput.restart(step)
    with stop_on_signals() as stop:
        while step < total:
            stacked, metrics, active = step_fn(stacked, batch, program.numbers, active)
            step += 1
            data_states = [lane.run.data.train.get_state() for lane in lanes]
            if step < total:
                batch = program.place([next(lane.run.data.train) for lane in lanes])
            if pending is not None:
                _note_divergence(lanes, alive, *pending, directory, record, diverged, log)
            pending = (step, active)
            signum = agree(stop.signum)
            final = step == total or signum is not None
            if not any(action.due(step, final) for lane in lanes for action in lane.actions):
                continue
            _note_divergence(lanes, alive, *pending, directory, record, diverged, log)
            pending = None
            rates.now = throughput.rates(step)  # every member's, over the same steps
            for index, lane in enumerate(lanes):
                if alive[index]:
                    member = program.member(stacked, index, lane.run)
                    metrics_of = program.member_metrics(metrics, index)
                    end = StepEnd(step, member, metrics_of, data_states[index], final)
                    due = [action for action in lane.actions if action.due(step, final)]
                    with tracing_layout(lane.run.mesh, cfg.mesh.rules):
                        run_actions(due, end, lane.run.checkpointer)
                    if end.values:
                        lane.writer.write(step, end.values)
            if signum is not None:
                for lane in lanes:
                    lane.run.checkpointer.wait()
                raise Interrupted(signum, step)
            throughput.restart(step)  # tokens/s times training steps alone, not evaluations
        if pending is not None:
            _note_divergence(lanes, alive, *pending, directory, record, diverged, log)
    for lane in lanes:
        lane.run.checkpointer.wait()
        lane.console.close()


class _StepRates:
    """The program's tokens/s and MFU per member at a logged step, taken once for all members
    (:class:`~.actions.LogTrain` asks for them member by member, between evaluations)."""

    now: tuple[float | None, float | None] = (None, None)

    def rates(self, step: int) -> tuple[float | None, float | None]:
        return self.now


def _note_divergence(lanes, alive, step, active, directory, record, diverged, log) -> None:
    """Marks the members whose step ``step`` was not finite (their flag in ``active`` fell)."""
    flags = np.asarray(active)
    for index, lane in enumerate(lanes):
        if alive[index] and not flags[index]:
            alive[index] = False
            diverged[lane.member.name] = step
            log(
                f"{lane.member.name}: the loss or a gradient is not finite at step {step}; the "
                f"member is frozen at step {step - 1} and trains no further (the others go on)"
            )
            _write_json(directory / SWEEP_FILE, record | {"diverged": diverged})


class _VmappedProgram:
    """A group's members as one vmapped step: their states stacked on a leading member axis,
    on a mesh whose ``member`` axis spreads the members over the devices (each device trains
    its share; as many members as divide the runs' ``data`` axis, the rest of it splitting each
    member's batch as in a run), their numbers as arrays."""

    def __init__(self, lanes: list[_Lane]):
        first = lanes[0].run
        self.first, self.size = first, len(lanes)
        self.mesh = member_mesh(first.mesh, self.size)
        self.rules = first.cfg.mesh.rules
        self.shardings = jax.tree.map(
            lambda s: NamedSharding(self.mesh, PartitionSpec("member", *s.spec)),
            first.built.shardings,
            is_leaf=lambda x: isinstance(x, NamedSharding),
        )
        self.member_sharding = NamedSharding(self.mesh, PartitionSpec("member"))
        self.numbers = jax.device_put(_lanes_numbers(lanes), self.member_sharding)

    def stack(self, states: list):
        """The members' states stacked, on the member mesh."""
        return jax.device_put(jax.tree.map(lambda *xs: jnp.stack(xs), *states), self.shardings)

    def member(self, stacked, index: int, run: StartedRun):
        """Member ``index``'s state, laid out as its run lays it out."""
        return jax.device_put(jax.tree.map(lambda x: x[index], stacked), run.built.shardings)

    def member_metrics(self, metrics: dict, index: int) -> dict:
        return {key: value[index] for key, value in metrics.items()}

    def active(self) -> jax.Array:
        return jax.device_put(jnp.ones(self.size, bool), self.member_sharding)

    def place(self, batches: list[dict]) -> dict:
        """``{key: [M, B, ...]}`` from each member's batch of this process's rows."""
        batch_spec = parallel.batch_sharding(self.first.mesh, self.rules).spec
        sharding = NamedSharding(self.mesh, PartitionSpec("member", *batch_spec))
        local = {key: np.stack([batch[key] for batch in batches]) for key in batches[0]}
        rows = self.first.cfg.train.batch_size
        shapes = {key: (self.size, rows, *value.shape[2:]) for key, value in local.items()}
        return jax.make_array_from_process_local_data(sharding, local, shapes)

    def compiled(self, stacked, batch, active, log):
        """The step compiled for these arrays, after checking that it fits the devices.

        Raises:
          ConfigError: the step needs more memory than a device has."""
        started = time.perf_counter()
        step = member_step(self.first.cfg, self.first.built.graphdef)
        spread = self.member_sharding
        jitted = jax.jit(
            jax.vmap(step, spmd_axis_name="member"),
            donate_argnums=0,
            out_shardings=(self.shardings, spread, spread),
        )
        with tracing_layout(self.mesh, self.rules):
            compiled = jitted.lower(stacked, batch, self.numbers, active).compile()
        members = self.size // self.mesh.shape["member"]
        _check_fits(_step_bytes(compiled), members)
        log(
            f"compiled one step for {self.size} members, vmapped, on mesh "
            f"{parallel.describe_mesh(self.mesh)} in {time.perf_counter() - started:.1f} s: "
            f"{_fit_text(_step_bytes(compiled), members)}"
        )
        return compiled


class _LoopProgram:
    """A group's members stepped one after another by one compiled step (a member's, not
    vmapped), each member's arrays laid out as its run's: on a CPU, whose cores one member's
    step keeps busy, a batched step is slower than its members' steps in turn."""

    def __init__(self, lanes: list[_Lane]):
        first = lanes[0].run
        self.first, self.size = first, len(lanes)
        self.replicated = NamedSharding(first.mesh, PartitionSpec())
        numbers = _lanes_numbers(lanes)
        self.numbers = [
            jax.device_put(jax.tree.map(lambda x, i=i: x[i], numbers), self.replicated)
            for i in range(self.size)
        ]

    def stack(self, states: list) -> list:
        return list(states)

    def member(self, states: list, index: int, run: StartedRun):
        return states[index]

    def member_metrics(self, metrics: list, index: int) -> dict:
        return metrics[index]

    def active(self) -> list:
        return [jax.device_put(jnp.asarray(True), self.replicated)] * self.size

    def place(self, batches: list[dict]) -> list:
        return [self.first.place(batch) for batch in batches]

    def compiled(self, states, batches, active, log):
        """Each member's step in turn, compiled once, after checking that every member's
        state fits the devices beside one step.

        Raises:
          ConfigError: they need more memory than a device has."""
        started = time.perf_counter()
        first = self.first
        jitted = jax.jit(
            member_step(first.cfg, first.built.graphdef),
            donate_argnums=0,
            out_shardings=(first.built.shardings, self.replicated, self.replicated),
        )
        with tracing_layout(first.mesh, first.cfg.mesh.rules):
            compiled = jitted.lower(states[0], batches[0], self.numbers[0], active[0]).compile()
        state_bytes = parallel.device_bytes(states[0], first.built.shardings)
        held = _step_bytes(compiled) + (self.size - 1) * state_bytes
        _check_fits(held, self.size)
        log(
            f"compiled one step for {self.size} members, run for each in turn, on mesh "
            f"{parallel.describe_mesh(first.mesh)} in {time.perf_counter() - started:.1f} s: "
            f"{_fit_text(held, self.size)}"
        )

        def step(states, batches, numbers, active):
            members = zip(states, batches, numbers, active, strict=True)
            results = [compiled(*member) for member in members]
            return tuple(list(outputs) for outputs in zip(*results, strict=True))

        return step


def _fit_text(per_device: int, members: int) -> str:
    return (
        f"{per_device / 2**20:,.1f} MiB per device for {members} member"
        f"{'s' if members > 1 else ''} ({per_device / members / 2**20:,.1f} MiB each)"
    )


def _check_fits(per_device: int, members: int) -> None:
    """Raises ConfigError when ``per_device`` bytes are more than a device has."""
    where, limit = parallel.device_memory_limit()
    if limit is not None and per_device > limit:
        raise ConfigError(
            f"the sweep's step needs {_fit_text(per_device, members)}; the {where} has "
            f"{limit / 2**20:,.0f} MiB: fewer members per program (vary fewer values), a "
            "smaller train.batch_size, or more devices"
        )


def member_step(cfg: TrainConfig, graphdef):
    """``step(state, batch, numbers, active) -> (state, metrics, active)``: a member's
    :func:`~.step.train_step` with its numbers (:func:`_member_numbers`) as arrays.

    A member whose ``active`` flag is off keeps its state; one whose step is not finite turns
    its flag off (unless ``train.skip_nonfinite``: then only that step is skipped)."""
    skip = cfg.train.skip_nonfinite

    def step(state, batch, numbers, active):
        tx = optimizer_of(cfg.optimizer, table_schedule(numbers["lr"]), numbers)
        new_state, metrics = train_step(
            graphdef,
            state,
            batch,
            task=task_of(cfg.model),
            label_smoothing=numbers["label_smoothing"],
            z_loss=numbers["z_loss"],
            loss_chunk=cfg.train.loss_chunk,
            grad_accum_steps=cfg.train.grad_accum_steps,
            tx=tx,
        )
        state = jax.lax.cond(active, lambda: new_state, lambda: state)
        return state, metrics, active & (metrics["finite"] | skip)

    return step


def program_key(cfg: TrainConfig) -> tuple[str, str]:
    """What a member's compiled step is made of: equal keys, one program. The step traced
    (its jaxpr: the model's graph, the optimizer's structure, the loss, every shape and dtype;
    not the numbers, which are arguments), and the settings of the loop that steps it."""
    mesh = resolve_mesh(cfg)[1]
    built = build_train_state(cfg, mesh, abstract=True)
    state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), built.state)
    steps = max(cfg.train.steps, 1)
    numbers = jax.tree.map(lambda x: x[0], _member_numbers([cfg], [jnp.zeros(steps)]))
    batch = abstract_batch(cfg, None)
    jaxpr = jax.make_jaxpr(member_step(cfg, built.graphdef))(state, batch, numbers, True)
    loop = {
        key: value
        for key, value in flatten(cfg.to_dict()).items()
        if key.split(".")[0] in ("train", "checkpoint", "mesh") and key not in PER_MEMBER
    }
    return str(jaxpr), repr(sorted(loop.items()))


def member_mesh(mesh: jax.sharding.Mesh, members: int) -> jax.sharding.Mesh:
    """``mesh`` with a ``member`` axis in front, taken from its ``data`` axis: as many devices
    as the largest divisor of both ``members`` and the ``data`` size (the members spread over
    them), the rest of ``data`` left to each member's batch."""
    data = mesh.shape["data"]
    spread = math.gcd(members, data)
    devices = mesh.devices.reshape(spread, data // spread, *mesh.devices.shape[1:])
    names = ("member", *mesh.axis_names)
    return jax.sharding.Mesh(devices, names, axis_types=(AxisType.Auto,) * len(names))


def _step_bytes(compiled) -> int:
    """The bytes a device holds while the compiled step runs: its arguments, outputs and
    temporaries, less the donated arguments' bytes the outputs reuse."""
    stats = compiled.memory_analysis()
    if stats is None:
        return 0
    held = stats.argument_size_in_bytes + stats.output_size_in_bytes + stats.temp_size_in_bytes
    return held - stats.alias_size_in_bytes


def _lanes_numbers(lanes: list[_Lane]) -> dict[str, jax.Array]:
    """The numbers of the lanes' members, stacked; their learning rates for ``train.steps``."""
    total = max(lanes[0].run.cfg.train.steps, 1)
    tables = [schedule_table(lane.run.built.schedule, total) for lane in lanes]
    return _member_numbers([lane.run.cfg for lane in lanes], tables)


def _member_numbers(configs: list[TrainConfig], tables: list) -> dict[str, jax.Array]:
    """Each member's numbers, stacked: ``lr`` ``[M, steps]`` (its schedule's rate by step),
    the optimizer's :data:`~.optim.NUMBERS` and the loss's, ``[M]`` float32."""
    numbers = {"lr": jnp.stack(tables)}
    for name in NUMBERS:  # an unset clip_norm clips nothing: its group's transformation has none
        values = [getattr(c.optimizer, name) for c in configs]
        numbers[name] = jnp.asarray([0.0 if v is None else v for v in values], jnp.float32)
    for name in LOSS_NUMBERS:
        numbers[name] = jnp.asarray([getattr(c.train, name) for c in configs], jnp.float32)
    return numbers


def _prefixed(name: str, log):
    return lambda message: log(f"{name}: {message}")


def _plain(value):
    return value if isinstance(value, str | int | float | bool) or value is None else str(value)


def _read_json(path: pathlib.Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise ConfigError(f"{path}: not a readable sweep record ({error})") from None


def _write_json(path: pathlib.Path, values: dict) -> None:
    """Written aside and renamed, by process 0: a killed write keeps the old file."""
    if jax.process_index() != 0:
        return
    partial = path.with_name(path.name + ".tmp")
    partial.write_text(json.dumps(values, indent=1) + "\n", encoding="utf-8")
    partial.replace(path)
