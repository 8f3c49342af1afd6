"""What a run checks before it starts or resumes, so that nothing is lost and nothing is trained
on by mistake: one check, :func:`check_resume`, that compares the run directory with the config
(its tokenizer, the data it was started on, the checkpoint's config and step, logged steps
without a checkpoint) and reports every difference at once, each with its way forward. After
the data are built, :func:`restore_data_state` compares the data pipeline with the checkpoint's,
and :func:`settled_config` settles what the run trains with (the tokenizer's vocabulary, the kept
schedule span).
"""

from __future__ import annotations

import dataclasses

from flaxformer_lite import parallel
from flaxformer_lite.data import (
    NAME_FILE,
    current_inputs,
    file_changes,
    read_inputs,
    setting_changes,
    store_of,
)
from flaxformer_lite.models.pieces import piece_sources
from flaxformer_lite.train.config import ConfigError, TrainConfig, config_diff, is_runtime_key
from flaxformer_lite.train.program import schedule_span
from flaxformer_lite.train.run_dir import RunDir, move_aside

_FRESH = "--fresh to move the run aside and start over"
_CHANGED_DATA = "going on with changed data"


@dataclasses.dataclass(frozen=True)
class Difference:
    """One way the run directory differs from the config it is run with.

    Attributes:
      what: what differs, as the heading of its lines.
      lines: ``  key: before -> now`` lines.
      way_forward: what the user can do about it.
      forced: what ``--force`` goes on with, in words; None: ``--force`` does not.
    """

    what: str
    lines: tuple[str, ...]
    way_forward: str
    forced: str | None = None

    def text(self) -> str:
        return "\n".join([f"{self.what}; {self.way_forward}" + ":" * bool(self.lines), *self.lines])


def stretch_schedule(cfg: TrainConfig) -> TrainConfig:
    """``cfg`` with its learning-rate schedule over all its ``train.steps``
    (``--stretch-schedule``): a resumed run whose steps were raised follows the schedule of
    the longer run from where it stands, instead of keeping the span it was trained with."""
    optimizer = dataclasses.replace(cfg.optimizer, schedule_steps=cfg.train.steps)
    return dataclasses.replace(cfg, optimizer=optimizer)


def keep_schedule_span(saved: TrainConfig, cfg: TrainConfig, log) -> TrainConfig:
    """``cfg`` resuming ``saved`` with the learning-rate schedule's span it was trained with:
    raising ``train.steps`` extends a run (as Orbax/MaxText users do) at the rate it ended with,
    instead of jumping back up a stretched cosine. ``optimizer.schedule_steps`` set by the user
    (a changed config: ``--force``) stretches it instead."""
    if cfg.optimizer.schedule_steps is not None:
        return cfg
    span = schedule_span(saved)
    if span == cfg.train.steps:
        return cfg
    if cfg.optimizer.schedule in ("cosine", "linear") and cfg.train.steps > span:
        end = cfg.optimizer.lr * cfg.optimizer.end_lr_ratio
        log(
            f"train.steps {saved.train.steps} -> {cfg.train.steps}: the {cfg.optimizer.schedule} "
            f"schedule keeps its {span}-step span, so the last {cfg.train.steps - span} steps "
            f"train at its end rate {end:.3g}; for a schedule over all {cfg.train.steps} steps, "
            "pass --stretch-schedule (this run goes on along the stretched schedule) or --fresh "
            "(start over)"
        )
    optimizer = dataclasses.replace(cfg.optimizer, schedule_steps=span)
    return dataclasses.replace(cfg, optimizer=optimizer)


def check_resume(
    run: RunDir,
    cfg: TrainConfig,
    saved: TrainConfig | None,
    saved_step: int | None,
    *,
    force: bool,
    main: bool,
    log,
) -> None:
    """Compares ``run`` (its checkpoint at ``saved_step`` written with config ``saved``, or
    none) with ``cfg`` before the data are built, and refuses every difference at once unless
    all of them are ones ``force`` goes on with; with ``force`` it logs them and moves aside what
    the old data made (their cached store; without a checkpoint, the tokenizer).

    Raises:
      ConfigError: one paragraph per difference, each with its way forward.
    """
    resuming = saved_step is not None
    recorded = read_inputs(run.inputs)
    # The data settings are compared once: with the record of the inputs, where the run has one.
    data_compared = recorded is not None
    differences = [
        *_data_inside_run(run, cfg),
        *_steps_done(run, cfg, saved_step),
        *_tokenizer_gone(run, resuming),
        *([] if recorded is None else _input_differences(run, cfg, recorded, resuming)),
        *([] if saved is None else _config_differences(saved, cfg, data_compared)),
        *_code_changed(run, cfg),
    ]
    if differences and (not force or any(d.forced is None for d in differences)):
        raise ConfigError("\n".join(d.text() for d in differences))
    if main and not resuming:
        _keep_metrics_without_checkpoint(run, log)
    if not differences:
        return
    for difference in differences:
        log(
            "\n".join(
                [f"{difference.forced} (--force)" + ":" * bool(difference.lines), *difference.lines]
            )
        )
    if main and any(d.forced == _CHANGED_DATA for d in differences):
        _move_old_data_aside(run, cfg, resuming, log)


def _data_inside_run(run: RunDir, cfg: TrainConfig) -> list[Difference]:
    """Data files inside the run directory (a glob over a folder that holds the run): the run
    would train on its own lock, logs and checkpoints, and find them changed when it resumes."""
    root = run.path.resolve()
    for key, (part, pattern) in cfg.data.paths().items():
        try:
            files = part.reader.files(pattern)  # none for a store, named by its directory
        except (OSError, ValueError):  # named when the data are built
            files = []
        inside = [f.resolve() for f in files if f.resolve().is_relative_to(root)]
        if inside:
            return [
                Difference(
                    f"{key}={pattern} matches files of the run directory {run} itself "
                    f"({', '.join(str(f.relative_to(root)) for f in inside[:3])})",
                    (),
                    "narrow the pattern to leave the run out, or choose a run_dir outside it",
                )
            ]
    return []


def _code_changed(run: RunDir, cfg: TrainConfig) -> list[Difference]:
    """A piece of the user's whose code differs from the code the run recorded: the same name,
    another function (an edited file, a name registered again)."""
    recorded = run.read_pieces() or {}
    changed = [
        setting
        for setting, fingerprint in piece_sources(cfg.model).items()
        if recorded.get(setting) not in (None, fingerprint) and fingerprint is not None
    ]
    if not changed:
        return []
    names = ", ".join(f"{key}={getattr(cfg.model, key.removeprefix('model.'))}" for key in changed)
    return [
        Difference(
            f"the code of {names} changed since {run} recorded it (pieces.json): its "
            "checkpoints were trained with the code as it was",
            (),
            f"put the code back, pass --force to go on with the new code, or {_FRESH}",
            forced=f"going on with the changed code of {names}",
        )
    ]


def _steps_done(run: RunDir, cfg: TrainConfig, saved_step: int | None) -> list[Difference]:
    if saved_step is None or saved_step <= cfg.train.steps:
        return []
    return [
        Difference(
            f"{run} is at step {saved_step} already, past train.steps={cfg.train.steps}",
            (),
            f"pass train.steps above {saved_step} to train on, or {_FRESH}",
        )
    ]


def _tokenizer_gone(run: RunDir, resuming: bool) -> list[Difference]:
    if not resuming or (run.tokenizer / NAME_FILE).is_file():
        return []
    return [
        Difference(
            f"{run.tokenizer} is missing: the checkpoint's token ids are that tokenizer's ids",
            (),
            f"put the run's tokenizer back in {run.tokenizer}, or pass {_FRESH}",
        )
    ]


def _keep_metrics_without_checkpoint(run: RunDir, log) -> None:
    """A run that logged steps but wrote no checkpoint (stopped by kill -9 or a full disk
    before its first) has nothing to resume and nothing to lose: it starts again at step 0, its
    metrics and TensorBoard events kept aside (``metrics.jsonl.old<N>``, ``tb.old<N>``)."""
    if run.has_checkpoint() or not run.metrics.is_file() or run.metrics.stat().st_size == 0:
        return
    kept = [move_aside(path) for path in (run.metrics, run.tensorboard) if path.exists()]
    log(
        f"{run} logged steps but wrote no checkpoint: starting again at step 0 (what it logged "
        f"is kept in {' and '.join(path.name for path in kept)})"
    )


def _input_differences(
    run: RunDir, cfg: TrainConfig, recorded: dict, resuming: bool
) -> list[Difference]:
    """The data files and settings against the ``recorded`` inputs; a given store that is gone
    is not a change ``--force`` can go on with, and other weights of a mixture's sources are
    said in one line."""
    source = cfg.data.reader
    if source.stored and not source.made_by_run:  # a given store, that the run cannot make again
        missing = [
            path for part, path in cfg.data.paths().values() if store_of(part, None, path) is None
        ]
        if missing:
            return [
                Difference(
                    f"no prepared store at {', '.join(missing)} (no manifest.json): the run was "
                    "started on the store there",
                    (),
                    "put the store back, or point data.path (data.validation_path) at a copy",
                )
            ]
    current = current_inputs(cfg.data)
    settings = setting_changes(recorded, current)
    weights = {key: change for key, change in settings.items() if _is_new_weight(key, change)}
    lines = [
        f"  {key}: {before!r} -> {now!r}"
        for key, (before, now) in settings.items()
        if key not in weights
    ]
    lines += file_changes(recorded, current)
    started = "trained" if resuming else "started (no checkpoint yet; its tokenizer was made)"
    differences = []
    if weights:
        changed = ", ".join(
            f"{key}: {before!r} -> {now!r}" for key, (before, now) in weights.items()
        )
        differences.append(
            Difference(
                f"{changed}: {run} was {started} on other weights",
                (),
                f"pass --force to go on with these weights from its step, or {_FRESH}",
                forced="going on with other weights",
            )
        )
    if lines:
        differences.append(
            Difference(
                f"the data differ from those {run} was {started} on",
                tuple(lines),
                f"pass --force to go on with these data, or {_FRESH}",
                forced=_CHANGED_DATA,
            )
        )
    return differences


def _is_new_weight(key: str, change: tuple) -> bool:
    """Whether a setting's change is another weight of a mixture's source that both sides have."""
    before, now = change
    is_weight = key.startswith("data.mixture.") and key.endswith(".weight")
    return is_weight and before is not None and now is not None


def _config_differences(
    saved: TrainConfig, cfg: TrainConfig, data_compared: bool = False
) -> list[Difference]:
    """The settings changed since the checkpoint, but the data settings when the record of the
    inputs compares them (``data_compared``): each change is named once."""
    changed = _changed_settings(saved, cfg)
    lines = [
        f"  {key}: {old!r} -> {new!r}"
        for key, (old, new) in changed.items()
        if not (data_compared and key.startswith("data."))
    ]
    if not lines:
        return []
    return [
        Difference(
            "the config differs from the checkpoint's",
            tuple(lines),
            f"pass --force to resume anyway, or {_FRESH}",
            forced="resuming with a changed config",
        )
    ]


def _changed_settings(saved: TrainConfig, cfg: TrainConfig) -> dict[str, tuple]:
    """The settings that differ from the checkpoint's, but those a run may change when it
    resumes (``train.steps``, the mesh, logging) and the vocabulary size (the tokenizer's)."""
    diff = config_diff(saved, cfg)
    # Unset, the span is the one the run was trained with (keep_schedule_span settles it): an
    # extended run records it, and extending or resuming it again must not read as a change.
    unset = cfg.optimizer.schedule_steps is None
    if unset or schedule_span(saved) == schedule_span(cfg):  # None and the steps it stood for
        diff.pop("optimizer.schedule_steps", None)
    # A schedule over all of train.steps, as the saved one was (--stretch-schedule): the
    # run's own shape of schedule, not a changed setting.
    if schedule_span(cfg) == cfg.train.steps and schedule_span(saved) == saved.train.steps:
        diff.pop("optimizer.schedule_steps", None)
    diff.pop("model.vocab_size", None)
    source = cfg.data.reader
    for key in [key for key in diff if key.startswith("data.")]:
        if source.same_setting(key.removeprefix("data."), *diff[key]):
            del diff[key]
    return {k: v for k, v in diff.items() if not is_runtime_key(k)}


def _move_old_data_aside(run: RunDir, cfg: TrainConfig, resuming: bool, log) -> None:
    """Under ``--force``, what the old data made: their cached store is prepared again (with the
    run's tokenizer when there is a checkpoint to resume, whose ids it must keep; else the
    tokenizer an earlier attempt left is made again from these data)."""
    for part, path in cfg.data.paths().values():
        cached = store_of(part, run.prepared, path)
        if cached is not None and cfg.data.reader.made_by_run:
            log(f"moved the store prepared from the old data to {move_aside(cached[0])}")
    if not resuming and run.tokenizer.exists():
        log(f"moved the tokenizer made from the old data to {move_aside(run.tokenizer)}")


def shapes_changed(error: Exception, saved: TrainConfig, cfg: TrainConfig) -> ConfigError:
    """The error for a checkpoint whose arrays ``cfg``'s model and optimizer do not have
    (``error`` says which): ``--force`` goes on with another config, but not other arrays."""
    keys = ", ".join(_changed_settings(saved, cfg)) or "no setting"
    return ConfigError(
        f"--force cannot change the checkpoint's arrays ({keys} changed): {error}; pass {_FRESH}"
    )


def restore_data_state(iterator, saved: dict, force: bool, log) -> None:
    """Sets the data iterator to the checkpoint's position. A pipeline that differs from the
    checkpoint's (another number of documents or tokens) though its config and inputs are the
    same is refused, showing the differences; with ``force`` the new pipeline goes on from the
    same step."""
    current = iterator.get_state()["pipeline"]
    before = saved.get("pipeline") if isinstance(saved, dict) else None
    if before is None or before == current:
        iterator.set_state(saved)
        return
    keys = sorted(set(before) | set(current), key=str)
    lines = [
        f"  {k}: {before.get(k)!r} -> {current.get(k)!r}"
        for k in keys
        if before.get(k) != current.get(k)
    ]
    if not force:
        raise ConfigError(
            "the training data differ from the checkpoint's; pass --force to go on with these "
            "data from the checkpoint's step, or --fresh to start over:\n" + "\n".join(lines)
        )
    log("resuming with changed data (--force), from the same step:\n" + "\n".join(lines))
    iterator.set_state({**saved, "pipeline": current})


def settled_config(cfg: TrainConfig, saved: TrainConfig | None, vocab_size: int, log):
    """``cfg`` with the tokenizer's vocabulary size and, resuming ``saved``, its schedule span.

    Raises:
      ConfigError: an ``init_from`` model with fewer embedding rows than its tokenizer's ids.
    """
    if cfg.init_from is not None:  # the embedding table may have more rows than ids
        if vocab_size > cfg.model.vocab_size:
            raise ConfigError(
                f"init_from={cfg.init_from}: the tokenizer has {vocab_size} "
                f"ids, the model {cfg.model.vocab_size} rows"
            )
    elif cfg.model.vocab_size != vocab_size:
        log(f"model.vocab_size set to the tokenizer's {vocab_size}")
        cfg = dataclasses.replace(cfg, model=cfg.model.replace(vocab_size=vocab_size))
    if saved is None:
        return cfg
    if saved.mesh != cfg.mesh:
        log(
            f"resuming on mesh {_mesh_text(cfg.mesh)}; the checkpoint was written on "
            f"{_mesh_text(saved.mesh)}: arrays are resharded as they are restored"
        )
    return keep_schedule_span(saved, cfg, log)


def _mesh_text(mesh_cfg) -> str:
    sizes = {name: getattr(mesh_cfg, name) for name in parallel.MESH_AXES}
    return " x ".join(f"{name} {size}" for name, size in parallel.shown_sizes(sizes).items())
