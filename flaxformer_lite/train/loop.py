"""A training run, start to finish: :func:`start` checks the run directory against the config
and builds the data, the train state (restored from the newest checkpoint) and the steps;
:func:`train` runs the steps, with logging, evaluation and checkpointing as actions that fire
at their steps (:mod:`.actions`), and stops cleanly on SIGTERM/SIGINT or a non-finite step.

Nothing here parses command lines; :mod:`flaxformer_lite.cli` does.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import time
from collections.abc import Callable
from typing import Any

import jax

from flaxformer_lite import parallel
from flaxformer_lite.data import Data, DataPlan, RunPaths
from flaxformer_lite.evals import Scorer, TaskFileError, Tasks
from flaxformer_lite.evals.tasks import read_tasks
from flaxformer_lite.models.piece_checks import PieceError, check_pieces, failed_with_pieces
from flaxformer_lite.models.pieces import piece_sources, user_pieces
from flaxformer_lite.train.actions import (
    Evaluate,
    FiniteCheck,
    StepEnd,
    Throughput,
    TrainingError,
    quiet,
)
from flaxformer_lite.train.background_compile import BackgroundCompile
from flaxformer_lite.train.checkpoint import Checkpointer, CheckpointShapeError
from flaxformer_lite.train.checkpoint_format import (
    base_record,
    check_base,
    from_savable,
    restore_target,
)
from flaxformer_lite.train.config import TrainConfig, config_from_dict
from flaxformer_lite.train.figures import pyplot as figure_pyplot
from flaxformer_lite.train.lanes import InTurn, Lane, LaneActions, Vmapped
from flaxformer_lite.train.metrics import plot_run
from flaxformer_lite.train.optim import check_parameters, optimizer_line
from flaxformer_lite.train.peak_flops import peak_flops
from flaxformer_lite.train.program import (
    TrainState,
    check_adapters,
    configured_train_step,
    flops_per_token,
    layout_lines,
    resolve_mesh,
    tracing_layout,
)
from flaxformer_lite.train.resume import (
    check_resume,
    restore_data_state,
    settled_config,
    shapes_changed,
)
from flaxformer_lite.train.run_dir import RunDir
from flaxformer_lite.train.signals import Interrupted, SignalAgreement, stop_on_signals
from flaxformer_lite.train.step import make_eval_step
from flaxformer_lite.train.step_numbers import step_numbers
from flaxformer_lite.train.time_spent import TimeSpent
from flaxformer_lite.train.trained_run import starting_state


def run(
    cfg: TrainConfig,
    *,
    fresh: bool = False,
    force: bool = False,
    progress: bool = True,
    log=print,
    spent: TimeSpent | None = None,
) -> dict[str, float]:
    """Trains ``cfg`` in ``cfg.run_dir``, resuming from its newest checkpoint; returns the last
    logged metrics.

    Every process of a multi-process run calls this with the same config (``cfg.distributed``
    connects them first); process 0 writes the run directory's files and logs, all of them
    take part in every step and checkpoint.

    Args:
      cfg: the run's configuration.
      fresh: move an existing run directory aside (to ``<run_dir>.old<N>``) and start over.
      force: resume even if the model, optimizer or data config changed.
      progress: show a progress bar (for a terminal); else print a line per logged step.
      log: where one-line messages go.
      spent: where the run's time goes, counted from its creation (the command's start);
        None: from this call.

    Raises:
      ConfigError: differences from the run directory (without ``force``), bad data or settings.
      ValueError: code named by import path (``models.pieces``) outside ``trusted_code``, or
        a user's piece that fails on small inputs.
      ValueError: a mesh that does not fit the devices, shapes that do not divide over it, a
        directory that is not a run (:class:`~.run_dir.NotARunError`) or one in use by another
        process (:class:`~.run_dir.RunDirInUseError`).
      TrainingError: a non-finite loss or gradient (the last good checkpoint is kept).
      Interrupted: SIGTERM / SIGINT (after the checkpoint is written).
    """
    spent = TimeSpent() if spent is None else spent
    check_pieces(cfg.model)  # code named by import path: refused or traced before any write
    check_parameters(cfg.optimizer, cfg.model)
    check_adapters(cfg)
    parallel.initialize(cfg.distributed)
    main = jax.process_index() == 0
    log, progress = (log, progress) if main else (quiet, False)
    run_dir = RunDir(cfg.run_dir)
    # Process 0 holds the directory's lock for the whole run (other processes share it).
    locked = run_dir.locked(fresh=fresh, log=log, removed_after=(PieceError, TaskFileError))
    with spent, locked if main else contextlib.nullcontext():
        _sync_processes("run directory ready")
        started = start(cfg, run_dir, force=force, log=log, spent=spent)
        # The data's prefetch thread ends with the run, however the run ends.
        with contextlib.closing(started.checkpointer), contextlib.closing(started.data.train):
            return train([Lane(started)], progress=progress, log=log)[0]


@dataclasses.dataclass(frozen=True)
class StartedRun:
    """A run ready to step: its settled config, data, restored state and compiled steps.

    Attributes:
      cfg: the config the run trains with (mesh sizes, vocabulary and schedule span settled),
        as ``RUN/config.yaml`` records it.
      run_dir: the run directory.
      mesh: the device mesh.
      data: the train and eval pipelines.
      checkpointer: the run's checkpoints.
      built: the train state's graphs, shardings and schedule.
      state: the train state at ``step``.
      step: the optimizer steps done (the restored checkpoint's, or 0).
      resumed: whether ``state`` was restored from a checkpoint.
      treedef: the state's tree structure (the steps take and return its leaves).
      numbers: the run's numbers, as its train step takes them (:mod:`.step_numbers`).
      train_step: the jitted train step, over the state's leaves
        (:func:`~.program.configured_train_step`).
      eval_step: the jitted eval step.
      place: puts a batch of this process's rows onto the mesh.
      tasks: the downstream tasks (``evals.tasks``) tokenized, or None.
      scorer: scores the tasks' requests in batches of the run's shape.
      base: a LoRA run's base, as its checkpoints name it (:func:`~.checkpoint_format.base_record`).
      spent: where the run's time goes.
    """

    cfg: TrainConfig
    run_dir: RunDir
    mesh: jax.sharding.Mesh
    data: Data
    checkpointer: Checkpointer
    built: TrainState
    state: Any
    step: int
    resumed: bool
    treedef: Any
    numbers: dict
    train_step: Callable
    eval_step: Callable
    place: Callable
    tasks: Tasks | None
    scorer: Scorer
    base: dict | None
    spent: TimeSpent


def start(
    cfg: TrainConfig,
    run_dir: RunDir,
    *,
    force: bool,
    log,
    spent: TimeSpent | None = None,
    initializers: dict | None = None,
) -> StartedRun:
    """Checks ``run_dir`` against ``cfg`` (every difference at once), builds the data and the
    train state, restores the newest checkpoint into it, and records the config; ``spent``
    (default: a new one) counts the time; ``initializers``: compiled initializers shared with
    other runs (:func:`~.program.build_train_state`)."""
    spent = TimeSpent() if spent is None else spent
    main = jax.process_index() == 0
    cfg, mesh = resolve_mesh(cfg)
    batch_sharding = parallel.batch_sharding(mesh, cfg.mesh.rules)
    parallel.check_batch_size(
        cfg.train.batch_size, mesh, cfg.mesh.rules, cfg.train.grad_accum_steps
    )
    checkpointer = Checkpointer(
        run_dir.checkpoints, keep=cfg.checkpoint.keep, every=cfg.checkpoint.every
    )
    try:
        resumed_step = checkpointer.latest_step()
        saved = None
        if resumed_step is not None:
            saved = config_from_dict(checkpointer.restore_config())
        check_resume(run_dir, cfg, saved, resumed_step, force=force, main=main, log=log)
        downstream = read_tasks(cfg.evals)  # a bad task file is refused before data are written
        _sync_processes("inputs checked")
        with spent.part("data"):
            data = _build_data(cfg, run_dir, batch_sharding, main)
            tasks = Tasks(downstream, data.tokenizer, cfg.data.seq_len) if downstream else None
        cfg = settled_config(cfg, saved, data.vocab_size, log)
        built = starting_state(cfg, mesh, saved is not None, initializers, log)
        state, step, base = built.state, 0, base_record(cfg, built.state)
        if saved is not None:
            try:
                with spent.part("checkpoints"):
                    restored = checkpointer.restore(restore_target(state))
            except CheckpointShapeError as error:  # --force takes another config, not arrays
                raise shapes_changed(error, saved, cfg) from None
            check_base(restored, base, checkpointer.directory)
            state = from_savable(restored.state, state)
            restore_data_state(data.train, restored.data_state, force, log)
            step = restored.step
            log(f"resumed from step {step} of {checkpointer.directory}")
    except BaseException:
        checkpointer.close()
        raise
    if main:
        run_dir.write_config(cfg.to_dict())
        if user_pieces(cfg.model):
            run_dir.write_pieces(piece_sources(cfg.model))
    place = functools.partial(
        parallel.put_batch, sharding=batch_sharding, global_batch=cfg.train.batch_size
    )
    for line in [
        *layout_lines(state, built.shardings, mesh),
        optimizer_line(cfg.optimizer, cfg.model),
        *(tasks.notices() if tasks else []),
    ]:
        if line is not None:
            log(line)
    return StartedRun(
        cfg=cfg,
        run_dir=run_dir,
        mesh=mesh,
        data=data,
        checkpointer=checkpointer,
        built=built,
        state=state,
        step=step,
        resumed=saved is not None,
        treedef=jax.tree.structure(state),
        numbers=step_numbers(cfg, built.schedule),
        train_step=configured_train_step(
            cfg, built.graphdef, built.shardings, jax.tree.structure(state)
        ),
        eval_step=make_eval_step(
            built.eval_graphdef, task=cfg.task, loss_chunk=cfg.train.loss_chunk
        ),
        place=place,
        tasks=tasks,
        scorer=Scorer(
            rows=cfg.train.batch_size,
            length=cfg.data.seq_len,
            place=place,
            shard=parallel.process_batch_shard(batch_sharding, cfg.train.batch_size),
            loss_chunk=cfg.train.loss_chunk,
        ),
        base=base,
        spent=spent,
    )


def train(
    lanes: list[Lane], *, progress: bool, log, vmap: bool = False, plots: bool = True
) -> list[dict[str, float]]:
    """Steps ``lanes`` (a run, or a sweep's members that share a program) to ``train.steps``;
    returns the metrics each logged last. A lane resumed at a later step than others waits for
    them.

    One compiled step advances every lane (:class:`~.lanes.InTurn`, or with ``vmap``
    :class:`~.lanes.Vmapped`), each on its own batches and numbers; each lane's actions fire at
    their steps. The host runs one step ahead of the devices: it dispatches step s, takes
    batch s + 1 (made, and placed on the devices, by each lane's prefetch thread) while s runs,
    and reads a step's results only when an action is due at it, or, for its finite flags, one
    step late, once the next step is dispatched. Between actions a state stays a list of its
    leaves, what the step takes and returns. The evaluation's programs, one set for all the
    lanes, compile on a thread of their own while the first steps run
    (:mod:`.background_compile`); matplotlib is imported on another, where each lane's plots are
    drawn while the last checkpoints are written (unless not ``plots``: a sweep draws its own)."""
    first = lanes[0].run
    cfg, total, spent = first.cfg, first.cfg.train.steps, first.spent
    step = start_step = min(lane.run.step for lane in lanes)
    main = jax.process_index() == 0
    if step == total:
        where = first.run_dir if len(lanes) == 1 else "the members"
        log(f"{where} is at step {step} = train.steps already; raise train.steps to go on")
    program = (Vmapped if vmap else InTurn)(lanes)
    tokens_per_step = cfg.train.batch_size * cfg.data.seq_len
    throughput = Throughput(tokens_per_step, flops_per_token(cfg, first.state), peak_flops(), log)
    program.prefetch()  # in the prefetch threads, beside the steps
    with spent.part("data"):
        batches = program.next_batches(step) if step < total else None
    states = program.stack([jax.tree.leaves(lane.run.state) for lane in lanes])
    active = program.active(step)
    # A sweep's step is compiled (and one that does not fit refused) before anything is logged.
    ahead = step < total and program.compile(states, batches, active, log)
    compiling = BackgroundCompile(spent)
    agree = SignalAgreement()
    plotter = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="plots")
    # The steps are traced under the mesh and rules: the layers pin their activations' layout.
    with contextlib.ExitStack() as stack:
        stop = stack.enter_context(stop_on_signals())
        loops = []
        for lane in lanes:
            loops.append(
                LaneActions(
                    lane, first.eval_step, throughput, compiling, progress, log, main, len(lanes)
                )
            )
            stack.callback(loops[-1].close)
        finite = FiniteCheck([each.on_nonfinite for each in loops], program)
        stack.enter_context(tracing_layout(first.mesh, cfg.mesh.rules))
        stack.enter_context(contextlib.closing(compiling))
        stack.enter_context(plotter)
        spent.loop_begins()
        while step < total and any(lane.alive for lane in lanes):
            started = time.perf_counter()
            with _naming_pieces(cfg.model) if step == start_step else contextlib.nullcontext():
                states, metrics, active = program.step(states, batches, active, step)
            if step == start_step:  # what the first evaluation and the end need, meanwhile
                shapes = first.treedef.unflatten(program.member_shapes(states, 0))
                compiling.start(
                    _evaluation_compiler(loops[0].evaluate, shapes, first.mesh, cfg.mesh.rules)
                )
                if main and plots:
                    plotter.submit(figure_pyplot)
            step += 1
            for each in loops:
                if each.lane.run.step < step:
                    each.console.advance()
            data_states = [lane.run.data.train.get_state() for lane in lanes]
            if step < total:
                taken = time.perf_counter()
                batches = program.next_batches(step)
                spent.add("data", time.perf_counter() - taken)
            finite.later(step, metrics)
            signum = agree(stop.signum)
            final = step == total or signum is not None
            due = [each.due(step, final) for each in loops]
            if throughput.started is not None and not any(due):
                continue
            # A checkpoint is written only after its step's flag is read (an error of a user's
            # piece may surface there, where the first step's results are read).
            with _naming_pieces(cfg.model) if step == start_step + 1 else contextlib.nullcontext():
                finite.now()
            if throughput.started is None and ahead:  # the first step, compiled before
                throughput.restart(step)
            elif throughput.started is None:  # the first step, which compiled
                throughput.compiled(step, started)
            throughput.hold(step)
            for index, each in enumerate(loops):
                if each.lane.alive and due[index]:
                    leaves = program.member(states, index)
                    end = StepEnd(
                        step,
                        each.lane.run.treedef.unflatten(leaves),
                        program.member_metrics(metrics, index),
                        data_states[index],
                        final,
                    )
                    each.act(due[index], end, spent)
            if signum is not None:
                with spent.part("checkpoints"):
                    for lane in lanes:
                        lane.run.checkpointer.wait()
                named = tuple(lane.name for lane in lanes if lane.name and lane.alive)
                raise Interrupted(signum, step, named)
            if any(due):  # tokens/s times training steps alone, not evaluations or saves
                throughput.restart(step)
        finite.now()
        # metrics.jsonl holds every step (flushed as written): the plots are drawn from it while
        # the last checkpoints are written, and both are done when the run returns.
        drawn_by = lanes if main and plots else []
        drawing = [plotter.submit(plot_run, lane.run.run_dir.path) for lane in drawn_by]
        with spent.part("checkpoints"):
            for lane in lanes:
                lane.run.checkpointer.wait()
        with spent.part("plots"):
            for drawn in drawing:
                drawn.result()
    return [lane.last for lane in lanes]


@contextlib.contextmanager
def _naming_pieces(model_cfg):
    """An error of the first step (its trace, compile or run) of a model with a user's pieces,
    named as theirs (:func:`~flaxformer_lite.models.piece_checks.failed_with_pieces`); the
    loop's own stops (a signal, a non-finite step, the disk, the device's memory) pass as they
    are."""
    try:
        yield
    except (Interrupted, TrainingError, OSError):
        raise
    except Exception as error:
        failure = (
            None if "RESOURCE_EXHAUSTED" in str(error) else failed_with_pieces(error, model_cfg)
        )
        if failure is None:
            raise
        raise failure from error


def _evaluation_compiler(evaluate: Evaluate, shapes, mesh, rules) -> Callable[[], None]:
    """What compiles ``evaluate``'s programs for a state of ``shapes`` (``jax.ShapeDtypeStruct``s
    with their shardings) as the loop traces them: under the mesh and rules."""

    def compile_evaluation() -> None:
        with tracing_layout(mesh, rules):
            evaluate.compile(shapes)

    return compile_evaluation


def _build_data(cfg: TrainConfig, run_dir: RunDir, batch_sharding, main: bool) -> Data:
    """This process's data: its share of each global batch; process 0 writes the run's files."""
    shard_index, shard_count = parallel.process_batch_shard(batch_sharding, cfg.train.batch_size)
    plan = DataPlan(
        cfg.data,
        task=cfg.task,
        seed=cfg.seed,
        batch_size=cfg.train.batch_size,
        paths=RunPaths(run_dir.tokenizer, run_dir.prepared, run_dir.inputs),
        process_index=shard_index,
        process_count=shard_count,
        writer=main,
        barrier=_sync_processes if jax.process_count() > 1 else None,
        init_from=cfg.init_from,
    )
    return plan.build()


def _sync_processes(name: str) -> None:  # every process of a run waits for the others here
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


__all__ = ["Interrupted", "Lane", "StartedRun", "TrainingError", "run", "start", "train"]
