"""A sweep: the members of :mod:`.sweep_members` trained in one command, those that share a
program advanced by one compiled step: vmapped over their states stacked on a member axis (on
accelerators), or run for each member in turn (on a CPU).

    summary = sweep(load_config(None, ["run_dir=runs/seeds", "train.steps=200"]),
                    {"seed": [0, 1, 2], "optimizer.lr": [1e-3, 3e-3]})
    summary["groups"]["lr=0.001"]["eval_loss"]  # {"mean": ..., "std": ..., "n": 3, ...}

Each member is a run (``<run_dir>/<member>``: config.yaml, metrics.jsonl, tb/, checkpoints,
tokenizer), started by :func:`.loop.start` as ``train.py`` starts one and trained by the run's
own loop (:func:`.loop.train`, each member a lane), so everything that reads a run reads a
member. A group's members step in lockstep, each on its own batches and its own numbers
(:mod:`.step_numbers`), as every run passes them; members resumed at later steps wait for the
others. A member whose step is not finite is frozen in the program at its last finite state and
trains no further; the others go on. ``<run_dir>/sweep.json`` (:class:`.sweep_dir.SweepDir`)
records the sweep (its members, the diverged ones) and, at the end, the summary
(:mod:`.sweep_summary`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pathlib
import shutil
from collections.abc import Mapping, Sequence
from typing import Any

import jax

from flaxformer_lite import parallel
from flaxformer_lite.data import check_data_files
from flaxformer_lite.evals import TaskFileError
from flaxformer_lite.evals.tasks import read_tasks
from flaxformer_lite.models.piece_checks import check_pieces
from flaxformer_lite.registry import trusted_code
from flaxformer_lite.train.actions import quiet
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
from flaxformer_lite.train.optim import check_parameters
from flaxformer_lite.train.program import (
    abstract_batch,
    build_train_state,
    check_adapters,
    numbered_step,
    resolve_mesh,
)
from flaxformer_lite.train.run_dir import RunDir
from flaxformer_lite.train.step_numbers import PER_MEMBER, numbers_aside, step_numbers
from flaxformer_lite.train.sweep_dir import SweepDir
from flaxformer_lite.train.sweep_members import Member, split_settings, sweep_members
from flaxformer_lite.train.sweep_plot import plot_sweep
from flaxformer_lite.train.sweep_summary import summarize, summary_table
from flaxformer_lite.train.time_spent import TimeSpent


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
        A vmapped sweep takes ``mesh.context=1``.
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
    members = recorded_names(sweep_members(cfg, vary), SweepDir(cfg.run_dir), fresh)
    for member in members:  # code named by import path, imported (if trusted) and traced
        check_pieces(member.cfg.model)
        check_parameters(member.cfg.optimizer, member.cfg.model)
        check_adapters(member.cfg)
    parallel.initialize(cfg.distributed)
    main = jax.process_index() == 0
    log = log if main else quiet  # every process trains, process 0 reports and writes
    groups = _groups(members)  # bad settings are refused before anything is written
    _check_data_files(members)
    if vmap is None:
        vmap = jax.devices()[0].platform != "cpu"
    context = max(resolve_mesh(member.cfg)[0].mesh.context for member in members)
    if vmap and context != 1:
        raise ConfigError(
            f"a vmapped sweep with mesh.context={context}: its member axis and the context axis "
            "do not share one step; pass --no-vmap (the members in turn) or mesh.context=1"
        )
    directory = SweepDir(cfg.run_dir)
    record = {"vary": {k: [_plain(v) for v in values] for k, values in vary.items()}}
    record["config"] = dataclasses.replace(cfg, run_dir="").to_dict()
    record["members"] = {m.name: {k: _plain(v) for k, v in m.settings.items()} for m in members}
    diverged = _open_directory(directory, record, fresh=fresh and main, force=force, log=log)
    groups = [kept for group in groups if (kept := [m for m in group if m.name not in diverged])]
    _announce(members, groups, diverged, log)
    prepared: dict[str, RunDir] = {}  # the first member to prepare each data's files
    with contextlib.ExitStack() as stack:
        for member in members:
            if main and member.name not in diverged:
                stack.enter_context(RunDir(member.cfg.run_dir).locked(log=log))
        for group in groups:
            _train_group(
                group,
                directory,
                record,
                diverged,
                force=force,
                vmap=vmap,
                log=log,
                spent=spent,
                prepared=prepared,
            )
            spent.loop_ends()
    summary = summarize(directory.path, members, diverged)
    directory.write(record | {"diverged": diverged, "summary": summary})
    log(summary_table(summary))
    if main:  # the groups' curves, in place of a plot per member (`plot DIR/<member>` draws it)
        with spent.part("plots"):
            _plot(directory, log)
    return summary


def _plot(directory: SweepDir, log) -> None:
    """Draws the sweep's figure; one that cannot be drawn (a member's metrics removed, links
    put in the directory meanwhile) is said, not raised: the training it shows is done."""
    try:
        written = plot_sweep(directory.path)
    except (ValueError, OSError) as error:
        log(f"warning: the sweep's figure was not drawn ({error}); flaxformer-lite plot draws it")
        return
    for path in written:
        log(f"wrote {path}")


def _check_data_files(members: list[Member]) -> None:
    """Each member's data files exist and hold text (:func:`~flaxformer_lite.data.plan.
    check_data_files`), and its task files read (``evals.tasks``), before the sweep writes
    anything.

    Raises:
      ConfigError: naming the member and the file."""
    for member in members:
        try:
            read_tasks(member.cfg.evals)
        except TaskFileError as error:
            raise ConfigError(f"{member.name}: {error}") from None
        data = member.cfg.data
        if not data.reader.stored or not (data.path or data.mixture):
            continue
        try:
            check_data_files(data)
        except (FileNotFoundError, ValueError) as error:
            raise ConfigError(f"{member.name}: {error}") from None


def recorded_names(members: list[Member], directory: SweepDir, fresh: bool) -> list[Member]:
    """``members`` under the names the sweep in ``directory`` recorded for the same settings:
    a sweep started before member names changed (``lr=0.001`` for ``lr=1e-3``, an import
    path's colon) resumes in its own directories."""
    if fresh or not directory.is_sweep():
        return members
    try:
        recorded = directory.read().get("members", {})
    except ValueError:  # refused, naming the file, when the directory is opened
        return members
    by_settings = {repr(sorted(settings.items())): name for name, settings in recorded.items()}
    renamed = []
    for member in members:
        plain = repr(sorted((k, _plain(v)) for k, v in member.settings.items()))
        name = by_settings.get(plain, member.name)
        cfg = dataclasses.replace(member.cfg, run_dir=str(directory.member(name).path))
        renamed.append(dataclasses.replace(member, name=name, cfg=cfg))
    return renamed


def _open_directory(directory: SweepDir, record: dict, *, fresh: bool, force: bool, log):
    """Checks ``directory`` for this sweep (new, empty, or the same sweep's), moves it aside
    with ``fresh``, records the sweep; returns its diverged members ``{name: step}``.

    Raises:
      ConfigError: a file, a run, a directory of other files, or another sweep.
      RunDirLinkError: symbolic links in it, which the sweep's writes would follow."""
    directory.refuse_if_not_a_sweep(written=(directory.library_log.name,))  # the command's
    if fresh and directory.is_sweep():
        directory.move_aside(log)
    diverged = {}
    with contextlib.ExitStack() as held:
        if directory.is_sweep():
            try:
                old = directory.read()
            except ValueError as error:
                raise ConfigError(str(error)) from None
            _check_same_sweep(directory.path, old, record, force)
            diverged = dict(old.get("diverged", {}))
            main = jax.process_index() == 0
            for run in directory.member_runs() if main else []:  # none trained by another process
                held.enter_context(run.held())
        if jax.process_index() == 0:
            directory.path.mkdir(parents=True, exist_ok=True)
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
    # A varied key's shared value is no member's: the members' own are compared above.
    changed = {k: v for k, v in changed.items() if not is_runtime_key(k) and k not in new["vary"]}
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
    group: list[Member], directory, record, diverged, *, force: bool, vmap, log, spent, prepared
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
            _reuse_prepared_data(member, prepared)
            started = start(
                member.cfg,
                RunDir(member.cfg.run_dir),
                force=force,
                log=say,
                spent=spent,
                initializers=initializers,
            )
            lanes.append(Lane(started, name=member.name, frozen=freezer(member.name)))
        for same_shapes in _by_state_shapes(lanes):
            _say_waiting(same_shapes, log)
            train(same_shapes, progress=False, log=log, vmap=vmap, plots=False)
    finally:
        for lane in lanes:
            lane.run.checkpointer.close()
            lane.run.data.train.close()


def _by_state_shapes(lanes: list[Lane]) -> list[list[Lane]]:
    """The lanes by the shapes of their states, in order: members traced as one program before
    their data were read may still differ in the vocabulary a tokenizer fitted on each one's
    files gave them, and then train as programs of their own."""
    groups: dict[tuple, list[Lane]] = {}
    for lane in lanes:
        shapes = tuple((x.shape, x.dtype) for x in jax.tree.leaves(lane.run.state))
        groups.setdefault(shapes, []).append(lane)
    return list(groups.values())


def _reuse_prepared_data(member: Member, prepared: dict[str, RunDir]) -> None:
    """Gives a member whose data settings equal an earlier member's, from files a run prepares
    (text, jsonl, parallel: the same whatever the seed), that member's tokenizer and prepared
    stores, hard-linked (written once, never changed), instead of tokenizing the files again;
    notes the first member of each data's settings. Process 0 writes the runs' files."""
    data, run = member.cfg.data, RunDir(member.cfg.run_dir)
    if jax.process_index() != 0 or not data.reader.made_by_run:
        return
    key = repr((data, member.cfg.init_from))
    if key not in prepared:
        prepared[key] = run
        return
    first = prepared[key]
    made = (run.tokenizer, run.prepared, run.inputs, run.checkpoints)
    if any(path.exists() for path in made) or not first.prepared.is_dir():
        return  # a member resumed (or to be refused), or data the first did not prepare
    if not first.tokenizer.is_dir():
        return
    for source, target in ((first.tokenizer, run.tokenizer), (first.prepared, run.prepared)):
        shutil.copytree(source, target, copy_function=_linked)


def _linked(source: str, target: str) -> None:
    """A hard link (the same file, in the member's own directory), else a copy."""
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def _say_waiting(lanes: list[Lane], log) -> None:
    """Names the members resumed at later steps than others (a sweep stopped while some saves
    were in flight, or before some members' first): they wait for the others."""
    start = min(lane.run.step for lane in lanes)
    for lane in lanes:
        if lane.run.step > start:
            log(f"{lane.name}: at step {lane.run.step}, waits for the members at step {start}")


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
