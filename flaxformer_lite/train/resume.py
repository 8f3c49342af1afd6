"""What a run checks before it starts or resumes, so that nothing is lost and nothing is
trained on by mistake: logged steps without a checkpoint, data that changed since the run was
started (:mod:`flaxformer_lite.train.run_inputs`), a data pipeline that changed since the
checkpoint, and the learning-rate schedule of a run resumed with more steps."""

from __future__ import annotations

import dataclasses
import pathlib

from flaxformer_lite.train.config import ConfigError, TrainConfig
from flaxformer_lite.train.metrics import METRICS_FILE
from flaxformer_lite.train.run_dir import move_aside
from flaxformer_lite.train.run_inputs import current_inputs, input_changes, read_inputs, store_of


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
    if cfg.optimizer.schedule in ("cosine", "linear"):
        log(
            f"train.steps {saved.train.steps} -> {cfg.train.steps}: the {cfg.optimizer.schedule} "
            f"schedule keeps its {span}-step span (after it the rate stays at its end value); "
            f"to stretch it instead, pass optimizer.schedule_steps={cfg.train.steps} --force"
        )
    optimizer = dataclasses.replace(cfg.optimizer, schedule_steps=span)
    return dataclasses.replace(cfg, optimizer=optimizer)


def schedule_span(cfg: TrainConfig) -> int:
    return cfg.optimizer.schedule_steps or cfg.train.steps


def restore_data_state(iterator, saved: dict, force: bool, log) -> None:
    """Sets the data iterator to the checkpoint's position. Data that changed since (another
    number of documents or tokens, batch size, sequence length or seed) are refused, showing
    the differences; with ``force`` the new pipeline goes on from the same step."""
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


def has_checkpoint(run_dir: pathlib.Path) -> bool:
    """Whether ``run_dir/checkpoints`` holds a step directory (finished or not)."""
    directory = run_dir / "checkpoints"
    return directory.is_dir() and any(p.name.isdigit() for p in directory.iterdir())


def check_inputs(cfg: TrainConfig, run_dir: pathlib.Path, force: bool, main: bool, log) -> None:
    """Refuses data that differ from those ``run_dir`` was started on (``RUN/inputs.json``),
    showing the differences. With ``force`` the run goes on with them: their cached store is
    prepared again (with the run's tokenizer when there is a checkpoint to resume, whose ids it
    must keep; else the tokenizer an earlier attempt left is made again from these data)."""
    recorded = read_inputs(run_dir)
    changes = [] if recorded is None else input_changes(recorded, current_inputs(cfg.data))
    if not changes:
        return
    resuming = has_checkpoint(run_dir)
    started = "trained" if resuming else "started (no checkpoint yet; its tokenizer was made)"
    if not force:
        raise ConfigError(
            f"the data differ from those {run_dir} was {started} on; pass --force to go on "
            "with these data, or --fresh to start over:\n" + "\n".join(changes)
        )
    log("going on with changed data (--force):\n" + "\n".join(changes))
    if not main:
        return
    cached = store_of(cfg.data, run_dir)
    if cached is not None and cfg.data.source != "prepared":
        log(f"moved the store prepared from the old data to {move_aside(cached[0])}")
    if not resuming and (run_dir / "tokenizer").exists():
        log(f"moved the tokenizer made from the old data to {move_aside(run_dir / 'tokenizer')}")


def refuse_to_overwrite_metrics(run_dir: pathlib.Path) -> None:
    """A run with logged steps but no checkpoint (deleted, or never written) would start over
    at step 0 and drop those steps' metrics and TensorBoard events: the user decides."""
    path = run_dir / METRICS_FILE
    if path.exists() and path.stat().st_size > 0:
        raise ConfigError(
            f"{path} holds logged steps but {run_dir / 'checkpoints'} has no checkpoint to "
            "resume from; pass --fresh to move the old run aside and start over"
        )
