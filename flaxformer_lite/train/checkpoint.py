"""Checkpoints of a training run, written and read by Orbax's ``CheckpointManager``.

    ckpt = Checkpointer(run_dir / "checkpoints", keep=3, every=500)
    ckpt.save(step, state, data_state=it.get_state(), config=cfg.to_dict(),
              metrics={"eval_loss": loss}, force=step == last_step)
    ...
    ckpt.save(step, ..., force=True); ckpt.wait()  # on SIGTERM / SIGINT, then exit
    restored = ckpt.restore(abstract_state)  # ShapeDtypeStructs carrying the current shardings
    ckpt.close()

A checkpoint holds one pytree of arrays (``state``: parameters, optimizer state, step, RNG key
data), the data-iterator state and the resolved config (both JSON), and a fingerprint of each
array. Orbax's on-disk layout::

    <directory>/<step>/state/        the arrays: TensorStore (OCDBT + Zarr), written per shard
    <directory>/<step>/data_state/   JSON
    <directory>/<step>/config/       JSON
    <directory>/<step>/fingerprints/ JSON, each array's dtype and fingerprint (below; ``base``)
    <directory>/<step>/metrics/      JSON, the ``metrics`` given to ``save`` (for "best" retention)
    <directory>/<step>.orbax-checkpoint-tmp/   a save in flight

Guarantees, and where they come from:
  * Async saves (orbax): ``save`` returns once the arrays are off the device; the files go into
    ``.orbax-checkpoint-tmp``, renamed to ``<step>`` when complete (GCS: ``commit_success.txt``).
    Only finished steps are listed, so a save killed midway is never picked up, and older
    checkpoints are deleted only after the new one is committed.
  * Retention (orbax preservation policies): the newest ``keep`` checkpoints, plus the single one
    with the lowest ``metrics["eval_loss"]`` among the saves that reported it.
  * Corruption (this module): a checkpoint that fails to restore (a truncated or missing file,
    an unreadable metrics item, arrays that differ from their fingerprints) is reported with a
    warning naming its step and the error, and the previous one is tried. When an older one
    restores, the unreadable ones are renamed ``<step>.corrupt`` so the resumed run can write
    those steps again; when none restores, nothing is moved and :class:`CheckpointError` says
    so. Orbax checksums its metadata but not array data: ``save`` records a uint32 fingerprint
    of each array (computed on its devices, independent of the sharding) and ``restore``
    checks the restored arrays against it, so damaged bytes of the right size are caught too.
    Checkpoints written without fingerprints restore unchecked.
  * Changed shapes (this module): a restore target whose array shapes differ from the
    checkpoint's raises :class:`CheckpointShapeError` (nothing is set aside: the checkpoint is
    fine, the model is not the one it was saved from).
  * Resharding (orbax): ``restore`` places each array on its target's sharding, any mesh.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import pathlib
import re
from collections.abc import Mapping
from typing import Any

import jax
import orbax.checkpoint as ocp
from orbax.checkpoint import checkpoint_managers as policies

from flaxformer_lite.train.checkpoint_format import abstract_leaf, changed_arrays
from flaxformer_lite.train.fingerprints import ALGORITHM, fingerprints_of, verify
from flaxformer_lite.train.orbax_threads import stop_background_saves

logger = logging.getLogger(__name__)


def _not_read_only_notice(record: logging.LogRecord) -> bool:
    """Drops Orbax's warnings that a manager is read-only: ``read_only`` is this class's request
    not to write (``load_run``, ``generate``), nothing a user has to hear about."""
    message = record.getMessage()
    return not message.startswith(
        ("Given directory is read only", "CheckpointManagerOptions.read_only=True")
    )


BEST_METRIC = "eval_loss"  # lower is better
FINGERPRINTS = "fingerprints"  # the item holding each array's fingerprint


class CheckpointError(OSError):
    """A checkpoint could not be written or restored, named with what to do (an ``OSError``:
    the run's environment, not its code)."""


class CheckpointShapeError(ValueError):
    """The restore target's arrays have other shapes or names than the checkpoint's (the model
    changed); the checkpoint is readable and kept."""


@dataclasses.dataclass(frozen=True)
class Restored:
    """What :meth:`Checkpointer.restore` returns: ``state`` on the requested shardings."""

    step: int
    state: Any
    data_state: dict[str, Any]
    config: dict[str, Any]
    base: dict[str, Any] | None = None


class Checkpointer:
    """Saves and restores a run's checkpoints in ``directory`` (one writing process per run).

    Args:
      directory: where the step directories live; created if missing.
      keep: how many of the newest checkpoints to keep (the best by eval loss is kept besides).
      every: ``save`` writes steps that are multiples of ``every`` (others only with ``force``).
      async_save: write in a background thread; :meth:`wait` blocks until it is done.
      read_only: only restore (``generate``, a training run may still be writing): nothing
        is created, moved or written, and the metrics item, needed only for retention, is
        not read.
    """

    def __init__(
        self,
        directory: pathlib.Path,
        *,
        keep: int,
        every: int = 1,
        async_save: bool = True,
        read_only: bool = False,
    ):
        for name, value in (("keep", keep), ("every", every)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"checkpoint {name} must be a positive int, got {value!r}")
        self.directory = pathlib.Path(directory).absolute()
        self.read_only = read_only
        # step -> why it cannot be restored; set aside only once an older one restores.
        self._unreadable: dict[int, str] = {}
        if not read_only:
            self._unreadable = _unreadable_metrics(self.directory)
        absl = logging.getLogger("absl")
        absl.addFilter(_not_read_only_notice)
        try:
            options = ocp.CheckpointManagerOptions(
                save_decision_policy=policies.FixedIntervalPolicy(every),
                preservation_policy=policies.AnyPreservationPolicy(
                    [
                        policies.LatestN(n=keep),
                        # BestN keeps the last n after sorting by the metric; reverse=True sorts
                        # descending, so the lowest eval loss is kept.
                        policies.BestN(
                            get_metric_fn=_eval_loss,
                            reverse=True,
                            n=1,
                            keep_checkpoints_without_metrics=False,
                        ),
                    ]
                ),
                # Orbax writes (and on restart reads back) the metrics item only when best_fn is
                # set; the preservation policy above is what decides retention.
                best_fn=None if read_only else _eval_loss,
                best_mode="min",
                enable_async_checkpointing=async_save,
                create=not read_only,
                read_only=read_only,
                # No metrics (nor commit times) read at start: read-only needs none, and orbax
                # fails on an unreadable one (they are read once those are set aside).
                lightweight_initialize=read_only or bool(self._unreadable),
            )
            self._manager = ocp.CheckpointManager(self.directory, options=options)
        finally:
            absl.removeFilter(_not_read_only_notice)
        self._in_flight: int | None = None
        self._failed = False

    def save(
        self,
        step: int,
        state: Any,
        *,
        data_state: Mapping[str, Any],
        config: Mapping[str, Any],
        metrics: Mapping[str, Any] | None = None,
        force: bool = False,
        base: Mapping[str, Any] | None = None,
    ) -> bool:
        """Starts writing checkpoint ``step``; True if it did (a multiple of ``every``, or
        ``force``). A step already saved is never rewritten (False).

        Waits for the previous save to finish first. With ``async_save`` it returns once
        ``state``'s arrays are copied off the device, so they may be donated or deleted next.

        Args:
          step: the optimizer step the state is at.
          state: a pytree of arrays (``jax.Array`` or numpy; typed PRNG keys work too).
          data_state: the data iterator's state, JSON-able (its ``get_state()`` dict).
          config: the resolved config, JSON-able (``TrainConfig.to_dict()``).
          metrics: scalars stored with the checkpoint; ``metrics["eval_loss"]`` ranks "best".
          force: save even when ``step`` is not a multiple of ``every`` (last step, SIGTERM).
          base: what names the arrays ``state`` leaves out (a LoRA run's base), JSON-able.
        """
        if step in self._manager.all_steps():
            return False
        # Checked here: orbax would only fail in the background thread, after save returned.
        data_state, config = _json_dict("data_state", data_state), _json_dict("config", config)
        fingerprints = {"algorithm": ALGORITHM, "arrays": fingerprints_of(state)}
        if base is not None:
            fingerprints["base"] = _json_dict("base", base)
        args = ocp.args.Composite(
            state=ocp.args.StandardSave(state),
            data_state=ocp.args.JsonSave(data_state),
            config=ocp.args.JsonSave(config),
            **{FINGERPRINTS: ocp.args.JsonSave(fingerprints)},
        )
        plain_metrics = {key: float(value) for key, value in (metrics or {}).items()}
        with self._stopping_on_failure():  # the previous save's error surfaces here too
            saved = self._manager.save(step, args=args, metrics=plain_metrics, force=force)
        if saved:
            self._in_flight = step
        return saved

    def wait(self) -> None:
        """Blocks until the save in flight is committed.

        Raises:
          CheckpointError: the save failed (the directory is not writable, the disk is full);
            orbax's background threads are stopped first.
        """
        with self._stopping_on_failure():
            self._manager.wait_until_finished()
        self._in_flight = None

    def close(self) -> None:
        """Waits for the save in flight, then releases orbax's threads (a failed save's
        threads were stopped when it failed: closing then raises nothing)."""
        if self._failed:
            return
        with self._stopping_on_failure():
            self._manager.close()
        self._in_flight = None

    @contextlib.contextmanager
    def _stopping_on_failure(self):
        """Turns a failed save into a :class:`CheckpointError` naming the directory, after
        stopping the orbax threads that would otherwise wait for it until their timeout (the
        process could not exit meanwhile)."""
        try:
            yield
        except Exception as error:  # orbax re-raises the background thread's error as it is
            self._failed = True
            stop_background_saves()
            raise CheckpointError(
                f"cannot write a checkpoint in {self.directory}: {error}; make it writable "
                "(or free disk space) and run again to resume from the last checkpoint"
            ) from error

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def all_steps(self) -> list[int]:
        """The steps of finished checkpoints, oldest first (a save in flight is not listed)."""
        steps = sorted(self._manager.all_steps())
        if self._in_flight is not None and self._manager.is_saving_in_progress():
            steps = [step for step in steps if step != self._in_flight]
        return steps

    def latest_step(self) -> int | None:
        """The newest finished checkpoint's step, or None."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def restore(self, abstract_state: Any, step: int | None = None) -> Restored:
        """The checkpoint at ``step`` (default: the newest that can be read).

        The restored arrays are checked against the fingerprints saved with them (those whose
        dtype the target changes are not). Without ``step``, unreadable checkpoints are skipped
        with a warning; once an older one restores they are set aside (``<step>.corrupt``),
        unless ``read_only``.

        Args:
          abstract_state: the pytree ``save`` was given, as ``jax.ShapeDtypeStruct`` leaves (or
            arrays) whose ``.sharding`` says where each restored array goes: a ``NamedSharding``
            on a concrete mesh (e.g. ``jax.make_mesh``, not the ``AbstractMesh`` of
            ``jax.eval_shape``), or a single device. Dtypes may differ from the saved ones (cast).
          step: restore this step, with no fallback.

        Raises:
          CheckpointError: no checkpoint, ``step`` missing, or none could be restored (nothing
            is set aside then).
          CheckpointShapeError: the checkpoint's arrays have other shapes or names than
            ``abstract_state``'s.
          ValueError: a leaf of ``abstract_state`` without a concrete sharding.
        """
        target = jax.tree_util.tree_map_with_path(abstract_leaf, abstract_state)

        def read(candidate: int):
            items = {
                "state": ocp.args.StandardRestore(target),
                "data_state": ocp.args.JsonRestore(),
                "config": ocp.args.JsonRestore(),
            }
            checked = (self.directory / str(candidate) / FINGERPRINTS).is_dir()  # older: none
            if checked:
                items[FINGERPRINTS] = ocp.args.JsonRestore()
            try:
                restored = self._manager.restore(candidate, args=ocp.args.Composite(**items))
            except Exception as error:
                if changed := changed_arrays(self.directory / str(candidate), target):
                    raise CheckpointShapeError(
                        f"checkpoint step {candidate} in {self.directory} holds other arrays "
                        f"than this model: {changed}"
                    ) from error
                raise
            if checked:
                verify(restored.state, restored[FINGERPRINTS])
            return restored

        step, items = self._restore(read, step, final=True)
        base = items[FINGERPRINTS].get("base") if FINGERPRINTS in items else None
        return Restored(step, items.state, dict(items.data_state), dict(items.config), base)

    def restore_config(self, step: int | None = None) -> dict[str, Any]:
        """Only the config of checkpoint ``step`` (default: the newest readable one). The
        unreadable ones are reported and set aside by the :meth:`restore` that follows, once it
        knows which one restores."""
        args = ocp.args.Composite(config=ocp.args.JsonRestore())
        _, items = self._restore(
            lambda candidate: self._manager.restore(candidate, args=args), step, final=False
        )
        return dict(items.config)

    def _restore(self, read, step: int | None, final: bool) -> tuple[int, Any]:
        """``read(step)``, or ``read`` of the newest checkpoint that can be read. The newer
        ones are remembered as unreadable; once one is read, a ``final`` read reports them
        (and, unless ``read_only``, sets them aside). None readable: one error, nothing moved."""
        steps = self.all_steps()
        if not steps:
            raise CheckpointError(f"no finished checkpoint in {self.directory}")
        if step is not None:
            if step not in steps:
                raise CheckpointError(
                    f"no checkpoint for step {step} in {self.directory} (it has steps {steps})"
                )
            try:
                return step, read(step)
            except CheckpointShapeError:
                raise
            except Exception as error:
                logger.debug("checkpoint step %d cannot be restored", step, exc_info=error)
                raise CheckpointError(
                    f"checkpoint step {step} in {self.directory} cannot be restored: "
                    f"{_error_line(error)}"
                ) from error
        for candidate in reversed(steps):
            if candidate in self._unreadable:
                continue
            try:
                items = read(candidate)
            except CheckpointShapeError:
                raise
            except Exception as error:  # orbax and TensorStore raise many types
                logger.debug("checkpoint step %d cannot be restored", candidate, exc_info=error)
                self._unreadable[candidate] = _error_line(error)
                continue
            if final:
                self._report_unreadable()
            return candidate, items
        newest = max(self._unreadable)
        hint = "" if self.read_only else "; pass --fresh to move the run aside and start over"
        raise CheckpointError(
            f"none of the checkpoints in {self.directory} (steps {steps}) can be restored "
            f"(step {newest}: {self._unreadable[newest]}){hint}"
        )

    def _report_unreadable(self) -> None:
        """A warning for each unreadable checkpoint; unless ``read_only``, renames their step
        directories to ``<step>.corrupt`` (kept for inspection, no longer listed), so the run
        resumed from an older step can save those steps again."""
        if not self._unreadable:
            return
        if self.read_only:
            for step, why in sorted(self._unreadable.items()):
                logger.warning(
                    "checkpoint step %d in %s cannot be restored, skipped: %s",
                    step,
                    self.directory,
                    why,
                )
            self._unreadable.clear()
            return
        if jax.process_index() == 0:
            for step, why in sorted(self._unreadable.items()):
                path = self.directory / str(step)
                aside = path.with_name(f"{step}.corrupt")
                suffix = 1
                while aside.exists():
                    aside, suffix = path.with_name(f"{step}.corrupt-{suffix}"), suffix + 1
                path.rename(aside)
                logger.warning(
                    "checkpoint step %d cannot be restored, moved to %s: %s", step, aside, why
                )
        if jax.process_count() > 1:  # the others list the steps only once they are moved
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices("unreadable checkpoints set aside")
        self._unreadable.clear()
        self._manager.reload()  # reads the metrics of the steps left


def _unreadable_metrics(directory: pathlib.Path) -> dict[int, str]:
    """The steps in ``directory`` whose metrics item is not a JSON object, and why: orbax reads
    every step's metrics when it opens the directory and would fail on the first bad one."""
    unreadable = {}
    for path in sorted(directory.glob("*/metrics/metrics")):
        step_dir = path.parent.parent
        if not step_dir.name.isdigit():
            continue
        try:
            ok = isinstance(json.loads(path.read_text()), dict)
        except (OSError, UnicodeDecodeError, ValueError) as error:
            logger.debug("%s", path, exc_info=error)
            ok = False
        if not ok:
            unreadable[int(step_dir.name)] = f"its metrics item {path} is unreadable"
    return unreadable


def _error_line(error: BaseException) -> str:
    """``error`` as one short line: TensorStore appends a many-line spec of the array it failed
    on (the whole error goes to the debug log)."""
    full = str(error)
    text = full.split("See full TensorStore details")[0].strip() or repr(error)
    line = text.splitlines()[0][:300]
    array = re.search(r"'path': '([^/'][^']*?)/?'", full)  # the spec's array, by its key path
    return f"{type(error).__name__}: {line}" + (f" (array {array[1]})" if array else "")


def _json_dict(name: str, value: Mapping[str, Any]) -> dict[str, Any]:
    """``value`` as a dict that JSON stores exactly (no tuples, no non-string keys)."""
    value = dict(value)
    try:
        exact = json.loads(json.dumps(value)) == value
    except (TypeError, ValueError) as error:
        raise TypeError(f"checkpoint {name} must be JSON-serializable: {error}") from None
    if not exact:
        raise TypeError(
            f"checkpoint {name} does not survive JSON unchanged (tuples become lists, keys "
            f"become strings): {value!r}"
        )
    return value


def _eval_loss(metrics: Mapping[str, Any]) -> float:
    """The ranking of a checkpoint's metrics: its eval loss, +inf when missing or NaN."""
    loss = metrics.get(BEST_METRIC) if isinstance(metrics, Mapping) else None
    return math.inf if loss is None or math.isnan(loss) else float(loss)
