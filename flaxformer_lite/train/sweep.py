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
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

import jax

from flaxformer_lite import parallel
from flaxformer_lite.models.pieces import check_pieces, trusted_code
from flaxformer_lite.train.actions import quiet
from flaxformer_lite.train.compilation_cache import use_compilation_cache
from flaxformer_lite.train.config import (
    ConfigError,
    TrainConfig,
    config_diff,
    config_from_dict,
    flatten,
    is_runtime_key,
)
from flaxformer_lite.train.lanes import Lane
from flaxformer_lite.train.loop import start, train
from flaxformer_lite.train.program import (
    abstract_batch,
    build_train_state,
    numbered_step,
    resolve_mesh,
)
from flaxformer_lite.train.resume import restore_data_state
from flaxformer_lite.train.run_dir import RunDir, move_aside
from flaxformer_lite.train.step_numbers import PER_MEMBER, numbers_aside, step_numbers
from flaxformer_lite.train.sweep_dir import SweepDir
from flaxformer_lite.train.sweep_members import Member, split_settings, sweep_members
from flaxformer_lite.train.sweep_summary import summarize, summary_table
from flaxformer_lite.train.time_spent import TimeSpent
from flaxformer_lite.train.trained_run import from_savable, restore_target


def sweep(
    cfg: TrainConfig,
    vary: Mapping[str, Sequence[Any]],
    *,
    fresh: bool = False,
    force: bool = False,
    vmap: bool | None = None,
    trust_code: bool = False,
    log=print,
    spent: TimeSpent | None = None,
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
      spent: where the sweep's time goes, counted from its creation (the command's start);
        None: from this call.

    Raises:
      ConfigError: a bad varied key or value, a directory that holds a run or another sweep,
        and what ``train.py`` refuses of a member.
    """
    spent = TimeSpent() if spent is None else spent
    with trusted_code(trust_code), spent:
        return _sweep(cfg, vary, fresh=fresh, force=force, vmap=vmap, log=log, spent=spent)


def _sweep(cfg: TrainConfig, vary, *, fresh: bool, force: bool, vmap, log, spent) -> dict:
    """:func:`sweep`, the code it names trusted or not."""
    use_compilation_cache(cfg.train.compilation_cache)
    members = sweep_members(cfg, vary)
    for member in members:  # code named by import path, imported (if trusted) and traced
        check_pieces(member.cfg.model)
    parallel.initialize(cfg.distributed)
    main = jax.process_index() == 0
    log = log if main else quiet  # every process trains, process 0 reports and writes
    groups = _groups(members)  # bad settings are refused before anything is written
    directory = SweepDir(cfg.run_dir)
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
            _train_group(
                group, directory, record, diverged, force=force, vmap=vmap, log=log, spent=spent
            )
            spent.loop_ends()
    summary = summarize(directory.path, members, diverged)
    directory.write(record | {"diverged": diverged, "summary": summary})
    log(summary_table(summary))
    return summary


def _open_directory(directory: SweepDir, record: dict, *, fresh: bool, force: bool, log):
    """Checks ``directory`` for this sweep (new, empty, or the same sweep's), moves it aside
    with ``fresh``, records the sweep; returns its diverged members ``{name: step}``.

    Raises:
      ConfigError: a file, a run, a directory of other files, or another sweep.
      RunDirLinkError: symbolic links in it, which the sweep's writes would follow."""
    path = directory.path
    if path.exists() and not path.is_dir():
        raise ConfigError(f"run_dir {path} is a file, not a sweep directory")
    if path.is_dir():
        RunDir(path).refuse_links()
    if RunDir(path).is_run():
        raise ConfigError(
            f"run_dir {path} holds a run (train.py's), not a sweep: choose another run_dir"
        )
    held = sorted(p.name for p in path.iterdir()) if path.is_dir() else []
    held = [name for name in held if name != directory.library_log.name]  # written first
    if held and not directory.is_sweep():
        held = ", ".join(held[:5])
        raise ConfigError(
            f"run_dir {path} is not a sweep directory: it holds {held} and no "
            f"{directory.record.name}; choose a new or empty run_dir"
        )
    if fresh and directory.is_sweep():
        log(f"--fresh: moved the previous sweep to {move_aside(path)}")
    diverged = {}
    if directory.is_sweep():
        try:
            old = directory.read()
        except ValueError as error:
            raise ConfigError(str(error)) from None
        _check_same_sweep(path, old, record, force)
        diverged = dict(old.get("diverged", {}))
    if jax.process_index() == 0:
        path.mkdir(parents=True, exist_ok=True)
    directory.write(record | {"diverged": diverged})
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


def _train_group(
    group: list[Member], directory, record, diverged, *, force: bool, vmap, log, spent
):
    """Starts the group's members as runs (each as ``train.py`` starts one) and trains them
    together in the run's loop, each a lane that a non-finite step freezes."""
    lanes: list[Lane] = []
    initializers: dict = {}  # one compiled initializer for the members' seeds

    def freezer(name: str):
        def frozen(step: int) -> None:
            diverged[name] = step
            log(
                f"{name}: the loss or a gradient is not finite at step {step}; the member is "
                f"frozen at step {step - 1} and trains no further (the others go on)"
            )
            directory.write(record | {"diverged": diverged})

        return frozen

    try:
        for member in group:
            say = _prefixed(member.name, log)
            started = start(
                member.cfg,
                RunDir(member.cfg.run_dir),
                force=force,
                log=say,
                spent=spent,
                initializers=initializers,
            )
            lanes.append(Lane(started, name=member.name, frozen=freezer(member.name)))
        _align_steps(lanes, log)
        if vmap is None:
            vmap = lanes[0].run.mesh.devices.flat[0].platform != "cpu"
        train(lanes, progress=False, log=log, vmap=vmap)
    finally:
        for lane in lanes:
            lane.run.checkpointer.close()
            lane.run.data.train.close()


def _align_steps(lanes: list[Lane], log) -> None:
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
        log(f"{lane.name}: back to step {common}, the step every member reached")
        lane.run = dataclasses.replace(run, state=state, step=common)


def program_key(cfg: TrainConfig) -> tuple[str, str]:
    """What a member's compiled step is made of: equal keys, one program. The step traced
    (its jaxpr: the model's graph, the optimizer's structure, the loss, every shape and dtype;
    not the numbers, which are arguments), and the settings of the loop that steps it."""
    mesh = resolve_mesh(cfg)[1]
    built = build_train_state(cfg, mesh, abstract=True)
    state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), built.state)
    numbers = step_numbers(cfg, built.schedule)
    batch = abstract_batch(cfg, None)
    jaxpr = jax.make_jaxpr(numbered_step(cfg, built.graphdef))(state, batch, numbers, True)
    loop = {
        key: value
        for key, value in flatten(cfg.to_dict()).items()
        if key.split(".")[0] in ("train", "checkpoint", "mesh") and key not in PER_MEMBER
    }
    return str(jaxpr), repr(sorted(loop.items()))


def _prefixed(name: str, log):
    return lambda message: log(f"{name}: {message}")


def _plain(value):
    return value if isinstance(value, str | int | float | bool) or value is None else str(value)
