"""The pieces of a run's train step that the training loop, :func:`~.trained_run.load_run` and
ahead-of-time compilation (:mod:`flaxformer_lite.aot`) share, so that all of them build and trace
the very same program: the mesh, the train state (model, optimizer and schedule) and the step."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from flaxformer_lite import parallel
from flaxformer_lite.models import build_model, training_flops_per_token
from flaxformer_lite.nn.lora import add_adapters, lora_scale, trainable
from flaxformer_lite.nn.rngs import dropout_rates
from flaxformer_lite.train.config import TrainConfig
from flaxformer_lite.train.optim import make_optimizer, optimizer_of, table_schedule
from flaxformer_lite.train.step import on_leaves, train_step
from flaxformer_lite.train.step_numbers import DROPOUT_NUMBERS, numbers_aside


def resolve_mesh(cfg: TrainConfig, devices=None) -> tuple[TrainConfig, jax.sharding.Mesh]:
    """The mesh of ``cfg.mesh`` over ``devices`` (default: all devices of all processes), and
    ``cfg`` with the mesh's sizes in place of a ``-1``.

    Raises:
      ValueError: sizes that do not fit the devices.
    """
    sizes = cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor
    mesh = parallel.make_mesh(*sizes, context=cfg.mesh.context, devices=devices)
    sizes = dict(mesh.shape)
    return dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, **sizes)), mesh


@dataclasses.dataclass(frozen=True)
class TrainState:
    """A run's ``(model, optimizer)`` split for the jitted steps, laid out on a mesh.

    Attributes:
      graphdef: the graph with dropout on (the train step's).
      eval_graphdef: the same graph with dropout off (evaluation, decoding, ``load_run``).
      state: the split state: arrays (created), or ``ShapeDtypeStruct``s carrying their
        shardings (abstract: what a checkpoint restores into, or what ``aot`` compiles).
      shardings: the state's ``NamedSharding``s, by ``cfg.mesh.rules``.
      schedule: the learning rate by optimizer step, over :func:`schedule_span` steps.
    """

    graphdef: nnx.GraphDef
    eval_graphdef: nnx.GraphDef
    state: Any
    shardings: Any
    schedule: Callable[[int], Any]


def build_train_state(
    cfg: TrainConfig,
    mesh: jax.sharding.Mesh,
    *,
    abstract: bool,
    initializers: dict[str, Callable] | None = None,
) -> TrainState:
    """The train state of ``cfg`` on ``mesh``: created (seeded by ``cfg.seed``) to start a run,
    or ``abstract`` to restore a checkpoint into or to compile for.

    The seed is an argument of the compiled initializer, so every seed of one config runs one
    program; ``initializers`` keeps it for the next config with the same state (a sweep's
    members: compiled once, however many seeds)."""
    tx, schedule = make_optimizer(cfg.optimizer, cfg.model, total_steps=schedule_span(cfg))
    create = functools.partial(make_train_state, cfg, tx)
    graphdef, state, shardings = parallel.abstract_sharded(create, mesh, cfg.mesh.rules)
    if not abstract:
        key = numbers_aside(cfg)  # what the state is made from, the seed and numbers aside
        initializers = {} if initializers is None else initializers
        if key not in initializers:
            initializers[key] = jax.jit(
                lambda seed: nnx.split(create(seed))[1], out_shardings=shardings
            )
        state = initializers[key](jnp.int32(cfg.seed))
    graphdef, eval_graphdef = train_and_eval_graphdefs(graphdef, state)
    return TrainState(graphdef, eval_graphdef, state, shardings, schedule)


def schedule_span(cfg: TrainConfig) -> int:
    """The steps the learning-rate schedule spans: ``optimizer.schedule_steps``, else the run's
    ``train.steps``."""
    return cfg.optimizer.schedule_steps or cfg.train.steps


def make_train_state(cfg: TrainConfig, tx, seed=None) -> tuple[nnx.Module, nnx.Optimizer]:
    """The run's ``(model, optimizer)`` as ``train.py`` creates them, seeded by ``seed`` (an int
    or a traced scalar; default ``cfg.seed``), with ``cfg.lora``'s adapters (the optimizer then
    over them alone); their split state is what a checkpoint holds
    (through :func:`~.checkpoint_format.to_savable`)."""
    seed = cfg.seed if seed is None else seed
    rngs = nnx.Rngs(params=jax.random.key(seed), dropout=jax.random.key(seed + 1))
    model = adapted_model(cfg, rngs)
    return model, nnx.Optimizer(model, tx, wrt=trainable(model))


def adapted_model(cfg: TrainConfig, rngs: nnx.Rngs) -> nnx.Module:
    """The model of ``cfg``, with ``cfg.lora``'s adapters drawn after its parameters (so the
    base is the seed's with or without them).

    Raises:
      ValueError: a ``lora.targets`` entry that names no projection, a ``lora.rank`` above a
        targeted matrix's smaller side.
    """
    model = build_model(cfg.model, rngs=rngs)
    if cfg.lora.rank is not None:
        add_adapters(
            model,
            rank=cfg.lora.rank,
            alpha=cfg.lora.alpha,
            targets=cfg.lora.targets,
            dropout_rate=cfg.lora.dropout,
            rslora=cfg.lora.rslora,
            rngs=rngs,
        )
    return model


def check_adapters(cfg: TrainConfig) -> None:
    """:func:`adapted_model`'s errors, and those of a PEFT adapter to start from
    (``lora.adapter``) that does not fit them, found on shapes alone before a run writes
    anything."""
    if cfg.lora.rank is None:
        return
    model = nnx.eval_shape(lambda: adapted_model(cfg, nnx.Rngs(0)))
    if cfg.lora.adapter is not None:
        from flaxformer_lite.interop.peft import peft_values

        scale = lora_scale(cfg.lora.alpha, cfg.lora.rank, cfg.lora.rslora)
        peft_values(nnx.state(model), cfg.model, cfg.lora.adapter, scale)


def configured_train_step(cfg: TrainConfig, graphdef, shardings, state_treedef=None):
    """The jitted train step of ``cfg`` (:func:`numbered_step`) for the state of ``graphdef``
    laid out by ``shardings``, the state donated and kept in its layout, the other results
    replicated; given ``state_treedef``, over the state's leaves (:func:`~.step.on_leaves`:
    no Python call per ``Variable`` at every step)."""
    step = numbered_step(cfg, graphdef)
    replicated = NamedSharding(jax.tree.leaves(shardings)[0].mesh, PartitionSpec())
    if state_treedef is not None:
        step, shardings = on_leaves(step, state_treedef), jax.tree.leaves(shardings)
    return jax.jit(step, donate_argnums=0, out_shardings=(shardings, replicated, replicated))


def numbered_step(cfg: TrainConfig, graphdef):
    """``step(state, batch, numbers, active) -> (state, metrics, active)``: ``cfg``'s
    :func:`~.step.train_step` (its task, loss chunks and microbatches) with its numbers
    (:func:`~.step_numbers.step_numbers`) as arguments, the learning rate read from their
    table at the optimizer's step.

    A state whose ``active`` flag is off is returned as it is (a sweep's frozen member); a step
    that is not finite turns the flag off, unless ``train.skip_nonfinite`` (then only that step
    is skipped)."""
    skip = cfg.train.skip_nonfinite

    def step(state, batch, numbers, active):
        tx = optimizer_of(cfg.optimizer, cfg.model, table_schedule(numbers["lr"]), numbers)
        rates = {kind: numbers[name] for name, kind in DROPOUT_NUMBERS.items()}
        with dropout_rates(rates):
            state, metrics = train_step(
                graphdef,
                state,
                batch,
                task=cfg.task,
                # Off, the loss skips the smoothing term (a mean over the vocabulary).
                label_smoothing=numbers["label_smoothing"] if cfg.train.label_smoothing else 0.0,
                z_loss=numbers["z_loss"],
                loss_chunk=cfg.train.loss_chunk,
                grad_accum_steps=cfg.train.grad_accum_steps,
                tx=tx,
                update=active,
            )
        return state, metrics, active & (metrics["finite"] | skip)

    return step


def flops_per_token(cfg: TrainConfig, state) -> float:
    """The training FLOPs per token of ``cfg``'s model
    (:func:`~flaxformer_lite.models.training_flops_per_token`), a LoRA run's with its base
    frozen and the adapters of ``state``."""
    adapters = jax.tree.leaves(nnx.filter_state(state[0], nnx.LoRAParam))
    count = sum(x.size for x in adapters) if adapters else None
    return training_flops_per_token(cfg.model, cfg.data.seq_len, adapter_params=count)


def layout_lines(state, shardings, mesh) -> list[str]:
    """The start-up summary of a train state laid out on ``mesh``: the mesh, the bytes of the
    parameters and of the optimizer state per device (of all), what trains where adapters do,
    and a warning for each large replicated parameter."""
    lines = [f"mesh: {parallel.describe_mesh(mesh)}"]
    params = nnx.filter_state(state[0], nnx.Param)
    param_shardings = nnx.filter_state(shardings[0], nnx.Param)
    parts = {"parameters": (params, param_shardings), "optimizer state": (state[1], shardings[1])}
    sizes = []
    for name, (part, part_shardings) in parts.items():
        layouts = parallel.array_layouts(part, part_shardings)
        total = sum(layout.total_bytes for layout in layouts)
        per_device = sum(layout.device_bytes for layout in layouts)
        sizes.append(f"{name} {_mib(per_device)} of {_mib(total)}")
    lines.append("per device: " + ", ".join(sizes))
    adapters = nnx.filter_state(state[0], nnx.LoRAParam)
    if jax.tree.leaves(adapters):
        count = functools.partial(sum, start=0)
        trained = count(x.size for x in jax.tree.leaves(adapters))
        total = count(x.size for x in jax.tree.leaves(params))
        lines.append(
            f"trainable: the LoRA adapters, {trained:,} of {total:,} parameters "
            f"({trained / total:.2%}); the base's {total - trained:,} stay as they are"
        )
    lines += [
        f"warning: {warning}"
        for warning in parallel.replicated_warnings(params, param_shardings, mesh)
    ]
    return lines


def _mib(num_bytes: int) -> str:
    return f"{num_bytes / 2**20:.2f} MiB"


@contextlib.contextmanager
def tracing_layout(mesh: jax.sharding.Mesh, rules):
    """The mesh and logical axis rules the steps are traced under: the layers pin their
    activations' layout by them."""
    with jax.set_mesh(mesh), nnx.logical_axis_rules(parallel.rule_pairs(rules)):
        yield


def train_and_eval_graphdefs(graphdef, state):
    """The graph of ``(model, optimizer)`` with dropout on, and with it off (``model.eval()``)."""
    model, optimizer = nnx.merge(graphdef, state, copy=True)
    model.train()
    train_graphdef = nnx.split((model, optimizer))[0]
    model.eval()
    return train_graphdef, nnx.split((model, optimizer))[0]


def abstract_batch(cfg: TrainConfig, sharding) -> dict[str, jax.ShapeDtypeStruct]:
    """The abstract global batch of ``cfg``'s task, each array split by ``sharding`` along its
    first axis: the arrays of :mod:`flaxformer_lite.data.tasks`, packed as the data pipeline
    packs them (``data.packing``; by default ``lm`` rows).

    Raises:
      ValueError: a model with continuous inputs or outputs (no token batches to describe), or
        ``data.packing=true`` for a task other than ``lm``.
    """
    if cfg.model.input_dim is not None or cfg.model.output_dim is not None:
        raise ValueError("compile takes token models; model.input_dim/output_dim are set")
    task = cfg.task
    shapes = task.batch_shapes(
        packed=task.is_packed(cfg.data.packing),
        batch_size=cfg.train.batch_size,
        seq_len=cfg.data.seq_len,
    )
    return {
        name: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
        for name, (shape, dtype) in shapes.items()
    }
