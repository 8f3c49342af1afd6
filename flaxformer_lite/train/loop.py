"""A training run, start to finish: resolve the config, build data, model and optimizer, resume
from the newest checkpoint, run the jitted steps, log, evaluate, checkpoint, and stop cleanly on
SIGTERM/SIGINT or on a non-finite step.

Nothing here parses command lines; :mod:`flaxformer_lite.cli` does.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import math
import pathlib
import signal
import time

import jax
import jax.numpy as jnp
import numpy as np
import yaml
from flax import nnx

from flaxformer_lite import parallel
from flaxformer_lite.data.hf_tokenizer import load_hf_tokenizer
from flaxformer_lite.data.pipeline import build_data, prepare_run_store
from flaxformer_lite.models import training_flops_per_token
from flaxformer_lite.train.checkpoint import Checkpointer
from flaxformer_lite.train.config import (
    ConfigError,
    TrainConfig,
    config_diff,
    config_from_dict,
    is_runtime_key,
)
from flaxformer_lite.train.console import Console
from flaxformer_lite.train.decode_eval import continue_texts, decodable, decode_eval
from flaxformer_lite.train.metrics import MetricsWriter, peak_flops, plot_run
from flaxformer_lite.train.optim import make_optimizer, warmup_notice
from flaxformer_lite.train.program import (
    configured_train_step,
    resolve_mesh,
    tracing_layout,
    train_and_eval_graphdefs,
)
from flaxformer_lite.train.restore import (
    from_savable,
    load_hf_weights,
    make_train_state,
    restore_target,
    to_savable,
)
from flaxformer_lite.train.resume import (
    check_inputs,
    has_checkpoint,
    keep_schedule_span,
    refuse_to_overwrite_metrics,
    restore_data_state,
    schedule_span,
)
from flaxformer_lite.train.run_dir import locked_run_dir
from flaxformer_lite.train.run_inputs import built_inputs, write_inputs
from flaxformer_lite.train.step import make_eval_step, task_of


class TrainingError(RuntimeError):
    """The run cannot go on (a non-finite step, a changed config); the message says why."""


class Interrupted(RuntimeError):  # noqa: N818 - raised on a signal, not an error of the run
    """SIGTERM or SIGINT arrived: a checkpoint was written and the run stopped."""

    def __init__(self, signum: int, step: int):
        super().__init__(f"{signal.Signals(signum).name} at step {step}: checkpoint saved")
        self.signum, self.step = signum, step


def run(
    cfg: TrainConfig, *, fresh: bool = False, force: bool = False, progress: bool = True, log=print
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

    Raises:
      ConfigError: a changed config on resume (without ``force``), bad data or settings.
      ValueError: a mesh that does not fit the devices, or shapes that do not divide over it.
      RunDirInUseError: another live process holds ``cfg.run_dir`` (:mod:`.run_dir`).
      TrainingError: a non-finite loss or gradient (the last good checkpoint is kept).
      Interrupted: SIGTERM / SIGINT (after the checkpoint is written).
    """
    parallel.initialize(cfg.distributed)
    main = jax.process_index() == 0
    log, progress = (log, progress) if main else (_quiet, False)
    run_dir = pathlib.Path(cfg.run_dir)
    # Process 0 holds the directory's lock for the whole run (other processes share it).
    with locked_run_dir(run_dir, fresh=fresh, log=log) if main else contextlib.nullcontext():
        _sync_processes("run directory ready")
        return _run(cfg, run_dir, main, force, progress, log)


def _run(cfg, run_dir, main, force, progress, log):
    """:func:`run`, in a directory this run holds."""
    run_dir.mkdir(parents=True, exist_ok=True)

    cfg, mesh = resolve_mesh(cfg)
    batch_sharding = parallel.batch_sharding(mesh, cfg.mesh.rules)
    parallel.check_batch_size(
        cfg.train.batch_size, mesh, cfg.mesh.rules, cfg.train.grad_accum_steps
    )
    shard_index, shard_count = parallel.process_batch_shard(batch_sharding, cfg.train.batch_size)
    task = task_of(cfg.model)
    if not has_checkpoint(run_dir):
        refuse_to_overwrite_metrics(run_dir)
    check_inputs(cfg, run_dir, force, main, log)
    _sync_processes("inputs checked")
    # init_from: the checkpoint's tokenizer, with its ids (a resumed run reads the saved copy).
    tokenizer = None if cfg.init_from is None else load_hf_tokenizer(cfg.init_from)
    if jax.process_count() > 1:  # process 0 fills a shared cache; the others then read it
        if main:
            prepare_run_store(cfg.data, run_dir / "tokenizer", tokenizer)
        _sync_processes("data prepared")
    data = build_data(
        cfg.data,
        task=task,
        seed=cfg.seed,
        batch_size=cfg.train.batch_size,
        directory=run_dir / "tokenizer",
        process_index=shard_index,
        process_count=shard_count,
        save_tokenizer=main,
        tokenizer=tokenizer,
    )
    if main:
        write_inputs(run_dir, built_inputs(cfg.data, run_dir))
    if cfg.init_from is not None:  # the embedding table may have more rows than ids
        if data.vocab_size > cfg.model.vocab_size:
            raise ConfigError(
                f"init_from={cfg.init_from}: the tokenizer has {data.vocab_size} "
                f"ids, the model {cfg.model.vocab_size} rows"
            )
    elif cfg.model.vocab_size != data.vocab_size:
        log(f"model.vocab_size set to the tokenizer's {data.vocab_size}")
        cfg = dataclasses.replace(cfg, model=cfg.model.replace(vocab_size=data.vocab_size))

    checkpointer = Checkpointer(
        run_dir / "checkpoints", keep=cfg.checkpoint.keep, every=cfg.checkpoint.every
    )
    # The data's prefetch thread ends with the run, however the run ends.
    with contextlib.closing(checkpointer), contextlib.closing(data.train):
        if checkpointer.latest_step() is not None:
            saved = config_from_dict(checkpointer.restore_config())
            cfg = keep_schedule_span(saved, cfg, log)
            _check_resumable(saved, cfg, force, log)
            if saved.mesh != cfg.mesh:
                log(
                    f"resuming on mesh {_mesh_text(cfg.mesh)}; the checkpoint was written on "
                    f"{_mesh_text(saved.mesh)}: arrays are resharded as they are restored"
                )
        if main:
            (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
        return _train(cfg, data, task, checkpointer, mesh, batch_sharding, progress, log, force)


def _train(cfg, data, task, checkpointer, mesh, batch_sharding, progress, log, force):
    run_dir, rules = pathlib.Path(cfg.run_dir), cfg.mesh.rules
    if notice := warmup_notice(cfg.optimizer, cfg.train.steps):
        log(notice)
    tx, schedule = make_optimizer(
        cfg.optimizer, total_steps=schedule_span(cfg), d_model=cfg.model.d_model
    )

    create = functools.partial(make_train_state, cfg, tx)
    resuming = checkpointer.latest_step() is not None
    make_state = parallel.abstract_sharded if resuming else parallel.create_sharded
    graphdef, state, shardings = make_state(create, mesh, rules)
    if cfg.init_from is not None and not resuming:  # a resumed run keeps its checkpoint
        state = load_hf_weights(state, cfg.init_from)
        log(f"initialized the model from {cfg.init_from}")
    graphdef, eval_graphdef = train_and_eval_graphdefs(graphdef, state)
    _log_layout(state, shardings, mesh, log)
    step = 0
    if resuming:
        restored = checkpointer.restore(restore_target(state))
        state = from_savable(restored.state, state)
        restore_data_state(data.train, restored.data_state, force, log)
        step = restored.step
        log(f"resumed from step {step} of {checkpointer.directory}")

    train_step = configured_train_step(cfg, graphdef, shardings)
    eval_step = make_eval_step(eval_graphdef, task=task)
    batch_size = cfg.train.batch_size

    def place(batch):
        return parallel.put_batch(batch, batch_sharding, batch_size)

    tokens_per_step = batch_size * cfg.data.seq_len
    flops_per_token = training_flops_per_token(cfg.model, cfg.data.seq_len)
    peak = peak_flops()
    main = jax.process_index() == 0
    writer = MetricsWriter(run_dir, resume_step=step, log=log) if main else _NoMetrics()
    for notice in data.notices:
        log(notice)
    total = cfg.train.steps
    console = Console(total, step, bar=progress, log=log)
    last: dict[str, float] = {}

    def check_finite(at: int, metrics) -> None:
        """Stops the run (or logs, with ``train.skip_nonfinite``) if step ``at`` was not finite;
        waits for that step to finish."""
        if bool(metrics["finite"]):
            return
        message = (
            f"step {at}: the loss or a gradient is not finite (loss "
            f"{float(metrics['loss'])}); the update was skipped"
        )
        if not cfg.train.skip_nonfinite:
            checkpointer.wait()  # a save in flight is good: name it as the last one
            good = checkpointer.latest_step()
            where = "none written yet" if good is None else f"step {good}"
            raise TrainingError(f"{message} and the run stopped; last good checkpoint: {where}")
        log(message)

    # The host runs one step ahead of the devices: it dispatches step s, takes and places batch
    # s + 1 while s runs, and reads a step's results only when they are due (logging, eval, a
    # checkpoint) or, for its finite flag, one step late, once the next step is dispatched.
    batch = place(next(data.train)) if step < total else None
    unchecked = None  # (step, metrics) of the step whose finite flag is not read yet
    window_start, window_step = None, step  # tokens/s: steady-state training steps only
    agree = _SignalAgreement()
    # The steps are traced under the mesh and rules: the layers pin their activations' layout.
    with (
        _stop_on_signals() as stop,
        contextlib.closing(writer),
        contextlib.closing(console),
        tracing_layout(mesh, rules),
    ):
        while step < total:
            started = time.perf_counter()
            state, metrics = train_step(state, batch)
            step += 1
            console.advance()
            # The state a checkpoint at this step saves: the batches handed out so far.
            data_state = data.train.get_state()
            if step < total:
                batch = place(next(data.train))
            if unchecked is not None:  # the previous step: its successor is queued already
                check_finite(*unchecked)
            unchecked = (step, metrics)
            signum = agree(stop.signum)
            final = step == total or signum is not None
            log_due = step % cfg.train.log_every == 0 or step == total
            eval_due = step % cfg.train.eval_every == 0 or step == total
            saving = final or step % cfg.checkpoint.every == 0
            if window_start is not None and not (log_due or eval_due or saving):
                continue
            # Due: wait for this step; a checkpoint is written only after its flag is read.
            check_finite(*unchecked)
            unchecked = None
            if window_start is None:  # the first step compiled: time the steady state after it
                log(f"compiled the train step in {time.perf_counter() - started:.1f} s")
                window_start, window_step = time.perf_counter(), step
            values = {}
            if log_due:
                elapsed = time.perf_counter() - window_start
                steps_timed = step - window_step
                tokens_per_sec = steps_timed * tokens_per_step / elapsed if steps_timed else None
                values = {k: float(metrics[k]) for k in ("loss", "accuracy", "grad_norm")}
                values["learning_rate"] = float(schedule(step - 1))
                values["tokens_per_sec"] = tokens_per_sec
                values["mfu"] = (
                    flops_per_token * tokens_per_sec / peak if peak and tokens_per_sec else None
                )
                console.logged(step, values)
            if eval_due:
                batches = map(place, data.eval_batches())
                scores = evaluate(eval_step, state, batches, cfg.train.eval_batches)
                if task in ("lm", "seq2seq"):
                    scores["eval_perplexity"] = math.exp(min(scores["eval_loss"], 80.0))
                model = nnx.merge(eval_graphdef, state)[0]
                scores |= _decoded_eval(cfg, data, task, model, step, console.say)
                console.evaluated(
                    step, scores, _eval_coverage(cfg, data, task, scores["eval_tokens"])
                )
                values |= scores
            if values:
                writer.write(step, values)
                last = values
            if saving:  # no state conversion on other steps
                checkpointer.save(
                    step,
                    to_savable(state),
                    data_state=data_state,
                    config=cfg.to_dict(),
                    force=final,
                    metrics={"eval_loss": values["eval_loss"]} if "eval_loss" in values else None,
                )
            if signum is not None:
                checkpointer.wait()
                raise Interrupted(signum, step)
            if values or saving:  # tokens/s times training steps alone, not evals or saves
                window_start, window_step = time.perf_counter(), step
        checkpointer.wait()
    if main:
        plot_run(run_dir)
    return last


def evaluate(eval_step, state, batches, max_batches: int | None = None) -> dict[str, float]:
    """Token-weighted ``eval_loss`` and ``eval_accuracy`` over every batch (or the first
    ``max_batches``), and ``eval_tokens``, the number of (weighted) tokens they are over.

    Each batch's means come back from the devices in float32; the sums over batches are made in
    float64 on the host, so a long validation set adds up exactly."""
    totals = {"loss": 0.0, "accuracy": 0.0, "num_tokens": 0.0}
    for batch in itertools.islice(batches, max_batches):
        metrics = eval_step(state, batch)
        count = float(metrics["num_tokens"])
        totals["num_tokens"] += count
        for key in ("loss", "accuracy"):
            totals[key] += float(metrics[key]) * count
    count = max(totals["num_tokens"], 1e-8)
    return {
        "eval_loss": totals["loss"] / count,
        "eval_accuracy": totals["accuracy"] / count,
        "eval_tokens": round(totals["num_tokens"]),  # weights are 0 or 1: a count
    }


def _eval_coverage(cfg, data, task: str, counted: float) -> str:
    """What an evaluation of ``counted`` weighted targets is over, in words: all the validation
    targets (tokens; a classifier's examples; an MLM's masked tokens), or the share
    ``train.eval_batches`` leaves."""
    what = {"classify": "examples", "mlm": "masked tokens"}.get(task, "tokens")
    capped = cfg.train.eval_batches
    if capped is None or capped >= data.eval_batch_count:
        return f"every one of {counted:,.0f} validation {what}"
    batches = f"train.eval_batches={capped} of {data.eval_batch_count} batches"
    if data.eval_tokens is None:
        return f"{counted:,.0f} validation {what} of the first {batches}"
    share = counted / max(data.eval_tokens, 1)
    return f"{counted:,.0f} of the {data.eval_tokens:,} validation tokens, {share:.1%}: {batches}"


def _decoded_eval(cfg, data, task, model, step: int, log) -> dict[str, float]:
    """Greedy-decodes ``train.decode_examples`` validation examples, logs ``train.log_samples``
    of them, and returns their scores; on plain text, logs ``train.log_samples`` sampled
    continuations of validation prompts (no score: text has no answer to compare with)."""
    if jax.process_count() > 1:  # the prompts are not split over processes
        return {}
    # One batch of prompts on whatever devices hold the parameters: no activation layout rules.
    with nnx.logical_axis_rules(()):
        if task == "lm" and cfg.train.log_samples and not decodable(task, data.eval_examples):
            samples = continue_texts(
                model,
                data.tokenizer,
                data.eval_examples,
                num_samples=cfg.train.log_samples,
                max_length=min(cfg.model.max_length, cfg.data.seq_len),
                seed=cfg.seed + step,
            )
            for number, sample in enumerate(samples, 1):
                log(f"step {step} sample {number} (prompt {sample.input!r}):\n{sample.prediction}")
            return {}
        if not cfg.train.decode_examples or not decodable(task, data.eval_examples):
            return {}
        values, samples = decode_eval(
            model,
            data.tokenizer,
            data.eval_examples,
            task=task,
            num_examples=cfg.train.decode_examples,
            max_length=cfg.model.max_length,
        )
    for sample in samples[: cfg.train.log_samples]:
        log(
            f"step {step} sample {sample.input!r} -> {sample.prediction!r} "
            f"(reference {sample.reference!r})"
        )
    return values


def _log_layout(state, shardings, mesh, log) -> None:
    """The start-up summary: the mesh, bytes per device, and large replicated parameters."""
    log(f"mesh: {parallel.describe_mesh(mesh)}")
    params = nnx.filter_state(state[0], nnx.Param)
    param_shardings = nnx.filter_state(shardings[0], nnx.Param)
    parts = {"parameters": (params, param_shardings), "optimizer state": (state[1], shardings[1])}
    sizes = []
    for name, (part, part_shardings) in parts.items():
        layouts = parallel.array_layouts(part, part_shardings)
        total = sum(layout.total_bytes for layout in layouts)
        per_device = sum(layout.device_bytes for layout in layouts)
        sizes.append(f"{name} {_mib(per_device)} of {_mib(total)}")
    log("per device: " + ", ".join(sizes))
    for warning in parallel.replicated_warnings(params, param_shardings, mesh):
        log(f"warning: {warning}")


def _mib(num_bytes: int) -> str:
    return f"{num_bytes / 2**20:.2f} MiB"


def _mesh_text(mesh_cfg) -> str:
    return f"data {mesh_cfg.data} x fsdp {mesh_cfg.fsdp} x tensor {mesh_cfg.tensor}"


def _sync_processes(name: str) -> None:
    """Waits until every process of a multi-process run gets here (no-op for one process)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


class _SignalAgreement:
    """The signal any process received, the same on all of them: they must stop at the same
    step, since the checkpoint they then write is collective (a process saving alone would wait
    forever for the others, already in the next step's collectives).

    With several processes the agreement is a max over the processes' signals queued behind each
    step and read one step late, like the finite flag: a blocking exchange every step would
    make the host wait for the devices. All processes read the same step's agreement, so all
    stop one step after the signal, at the same step."""

    def __init__(self):
        self._pending = None
        if jax.process_count() > 1:
            mesh = jax.sharding.Mesh(np.array(jax.devices()), ("devices",))
            self._sharding = jax.NamedSharding(mesh, jax.P("devices"))
            self._max = jax.jit(jnp.max, out_shardings=jax.NamedSharding(mesh, jax.P()))

    def __call__(self, signum: int | None) -> int | None:
        """The agreed signal, given this process's ``signum`` after a step (None: none)."""
        if jax.process_count() == 1:
            return signum
        local = np.full(jax.local_device_count(), signum or 0, np.int32)
        received = jax.make_array_from_process_local_data(
            self._sharding, local, (jax.device_count(),)
        )
        agreed, self._pending = self._pending, self._max(received)
        return None if agreed is None else int(agreed) or None


def _quiet(_message: str) -> None:
    pass


class _NoMetrics:
    """The metrics writer of processes other than 0: they compute the metrics, 0 writes them."""

    def write(self, step: int, values) -> None:
        pass

    def close(self) -> None:
        pass


def _check_resumable(saved: TrainConfig, cfg: TrainConfig, force: bool, log) -> None:
    diff = config_diff(saved, cfg)
    if schedule_span(saved) == schedule_span(cfg):  # None and the steps it stood for
        diff.pop("optimizer.schedule_steps", None)
    changed = {k: v for k, v in diff.items() if not is_runtime_key(k)}
    lines = [f"  {key}: {old!r} -> {new!r}" for key, (old, new) in changed.items()]
    if changed and not force:
        raise ConfigError(
            "the config differs from the checkpoint's; pass --force to resume "
            "anyway or --fresh to start over:\n" + "\n".join(lines)
        )
    if changed:
        log("resuming with a changed config (--force):\n" + "\n".join(lines))


class _StopFlag:
    signum: int | None = None


@contextlib.contextmanager
def _stop_on_signals():
    """Turns SIGTERM / SIGINT into a flag the loop checks after each step."""
    flag = _StopFlag()

    def handler(signum, _frame):
        flag.signum = signum

    previous = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield flag
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


__all__ = ["Interrupted", "TrainingError", "evaluate", "from_savable", "run", "to_savable"]
