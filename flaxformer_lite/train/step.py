"""The train and eval steps: pure functions of the split model + optimizer state, jitted once,
with the state donated so parameters and moments are updated in place.

The loss of every task is written once (:func:`model_loss`; each task's model call is its
:class:`~flaxformer_lite.data.tasks.Task`'s); gradient accumulation sums the
microbatches' token-weighted gradients, so ``k`` microbatches give the gradient of the whole batch.
A step whose loss or gradients are not finite leaves the state untouched and says so.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from flaxformer_lite import ops
from flaxformer_lite.data import Task
from flaxformer_lite.models.heads import head_projection
from flaxformer_lite.nn.context_parallel import sequence_shards, shard_rows, to_context_layout


def model_loss(
    model,
    batch: dict,
    *,
    task: Task,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    loss_chunk: int | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """``ops.cross_entropy`` of the model's predictions for ``batch``, a batch of ``task`` as
    its :class:`~flaxformer_lite.data.tasks.Task` describes it (packed ``lm`` rows add
    ``segment_ids`` and ``positions``; a ``classify`` batch may leave out its ``weights``).

    With ``loss_chunk`` the token tasks take ``ops.chunked_cross_entropy`` of the model's
    features and output head instead: the same loss, never the logits of the whole batch at once
    (``classify`` has one logit row per example and ignores it).
    """
    features = loss_chunk is not None and task.per_token
    shards = sequence_shards()  # above 1 for decoder LMs only (TrainConfig refuses the others)
    if shards > 1:  # a loss over tokens: the same in any order
        batch = to_context_layout(batch, shards)
    outputs = task.predict(model, batch, features=features)
    targets, weights = task.targets(batch)
    if features and shards > 1:  # the loss's blocks stay on their devices
        outputs, targets, weights = (shard_rows(x, shards) for x in (outputs, targets, weights))
    loss_kwargs = dict(weights=weights, label_smoothing=label_smoothing, z_loss=z_loss)
    if features:
        return ops.chunked_cross_entropy(
            outputs, targets, head_projection(model), chunk=loss_chunk, **loss_kwargs
        )
    return ops.cross_entropy(outputs, targets, **loss_kwargs)


def make_train_step(
    graphdef,
    *,
    task: Task,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    loss_chunk: int | None = None,
    grad_accum_steps: int = 1,
    state_shardings=None,
    state_treedef=None,
):
    """``step(state, batch) -> (state, metrics)``: :func:`train_step` jitted, ``state`` donated.

    ``state_shardings`` (:func:`flaxformer_lite.parallel.state_shardings`) keeps the new state in
    the layout of the old one and returns the metrics replicated. Traced under
    ``jax.set_mesh`` and ``nnx.logical_axis_rules``, the layers pin their activations' layout.

    With ``state_treedef`` (the state's ``jax.tree.structure``) the step takes and returns the
    state's leaves, a list, in its place: the same program. ``jax.jit`` flattens its arguments
    and unflattens its results at every call, and an nnx state does both through a Python call
    per ``Variable``, host time that a training loop pays every step; a list of arrays costs
    none of it.
    """
    out_shardings = None
    if state_shardings is not None:
        mesh = jax.tree.leaves(state_shardings)[0].mesh
        if state_treedef is not None:
            state_shardings = jax.tree.leaves(state_shardings)
        out_shardings = (state_shardings, NamedSharding(mesh, PartitionSpec()))
    step = functools.partial(
        train_step,
        graphdef,
        task=task,
        label_smoothing=label_smoothing,
        z_loss=z_loss,
        loss_chunk=loss_chunk,
        grad_accum_steps=grad_accum_steps,
    )
    if grad_accum_steps < 1:
        raise ValueError(f"grad_accum_steps must be >= 1, got {grad_accum_steps}")
    if state_treedef is not None:
        step = on_leaves(step, state_treedef)
    return jax.jit(step, donate_argnums=0, out_shardings=out_shardings)


def on_leaves(step, state_treedef):
    """``step(state, *args) -> (state, *results)`` as a function of the state's leaves:
    ``(leaves, *args) -> (leaves, *results)``."""

    def step_on_leaves(leaves: list, *args):
        state, *results = step(state_treedef.unflatten(leaves), *args)
        return jax.tree.leaves(state), *results

    return step_on_leaves


def train_step(
    graphdef,
    state,
    batch: dict,
    *,
    task: Task,
    label_smoothing=0.0,
    z_loss=0.0,
    loss_chunk: int | None = None,
    grad_accum_steps: int = 1,
    tx: optax.GradientTransformation | None = None,
    update=True,
):
    """One optimizer step of the split ``(model, optimizer)`` state on ``batch``: ``(state,
    metrics)``, to be jitted: by :func:`make_train_step` with its numbers as constants, or, as
    every run's step, by :func:`~flaxformer_lite.train.program.configured_train_step` with them
    as arguments (vmapped over a sweep's members on accelerators).

    ``graphdef, state = nnx.split((model, optimizer))``; ``optimizer`` an ``nnx.Optimizer`` over
    what trains (``nnx.Param``, or a LoRA model's ``nnx.LoRAParam``s: the rest is kept as it
    is), which applies the update, or ``tx`` in its place (a transformation with the
    same state, whose numbers may be arrays). With ``grad_accum_steps = k`` microbatch ``i`` is
    rows ``i, i + k, ...`` of the batch, run one after another (``lax.scan``), for k times less
    activation memory; every device keeps computing on its own rows. Metrics: ``loss``,
    ``z_loss``, ``accuracy``, ``num_tokens``, ``grad_norm`` and ``finite`` (False when the loss
    or a gradient was NaN/Inf; the state is then returned unchanged, as it is where ``update``, a
    bool or a traced flag, is False: a sweep's frozen member). ``label_smoothing`` and
    ``z_loss`` (floats or scalar arrays) and ``loss_chunk`` positions at a time: as
    :func:`model_loss`.
    """
    loss_kwargs = dict(
        task=task, label_smoothing=label_smoothing, z_loss=z_loss, loss_chunk=loss_chunk
    )
    model, optimizer = nnx.merge(graphdef, state)
    trained = optimizer.wrt  # every Param, or a LoRA run's adapters alone
    model_def, params, rest = nnx.split(model, trained, ...)

    def micro_step(carry, micro):
        grads_sum, rest, totals = carry

        def token_sum(params):
            # Fresh Variables: those of `rest` belong to the scan's trace, not grad's.
            micro_model = nnx.merge(model_def, params, rest, copy=True)
            loss, metrics = model_loss(micro_model, micro, **loss_kwargs)
            count = metrics["num_tokens"]
            return loss * count, (metrics, nnx.state(micro_model, nnx.Not(trained)))

        grads, (metrics, rest) = jax.grad(token_sum, has_aux=True)(params)
        count = metrics["num_tokens"]
        totals = {k: totals[k] + metrics[k] * (1 if k == "num_tokens" else count) for k in totals}
        return (jax.tree.map(jnp.add, grads_sum, grads), rest, totals), None

    batch_size = jax.tree.leaves(batch)[0].shape[0]
    if batch_size % grad_accum_steps:
        raise ValueError(
            f"batch size {batch_size} is not divisible by grad_accum_steps={grad_accum_steps}"
        )
    microbatches = jax.tree.map(
        lambda x: x.reshape(
            x.shape[0] // grad_accum_steps, grad_accum_steps, *x.shape[1:]
        ).swapaxes(0, 1),
        batch,
    )
    zeros = jax.tree.map(jnp.zeros_like, params)
    totals = {k: jnp.zeros((), jnp.float32) for k in ("loss", "z_loss", "accuracy", "num_tokens")}
    (grads_sum, rest, totals), _ = jax.lax.scan(micro_step, (zeros, rest, totals), microbatches)
    count = jnp.maximum(totals["num_tokens"], 1e-8)
    grads = jax.tree.map(lambda g: g / count, grads_sum)
    metrics = {k: v / count if k != "num_tokens" else v for k, v in totals.items()}
    metrics["grad_norm"] = optax.tree_utils.tree_norm(grads)
    finite = jnp.isfinite(metrics["loss"] + metrics["z_loss"]) & jnp.isfinite(metrics["grad_norm"])
    metrics["finite"] = finite

    def apply_update(state):
        model, optimizer = nnx.merge(graphdef, state)
        if tx is not None:
            optimizer.tx = tx
        nnx.update(model, rest)
        optimizer.update(model, grads)
        return nnx.state((model, optimizer))

    # The update runs inside the taken branch, so XLA writes the new state over the donated
    # old one; choosing between an updated copy and the old state afterwards would keep both
    # alive: the whole state once more in temporary memory, mapped afresh every step.
    state = jax.lax.cond(finite & update, apply_update, lambda state: state, state)
    return state, metrics


def make_eval_step(eval_graphdef, *, task: Task, loss_chunk: int | None = None):
    """``eval_step(state, batch) -> metrics`` with ``loss``, ``accuracy`` and ``num_tokens``
    (for token-weighted averages over batches); ``loss_chunk`` as for :func:`model_loss`.

    ``eval_graphdef`` is ``nnx.split((model, optimizer))[0]`` taken after ``model.eval()``: the
    dropout switches are part of the graph, the state is the training state unchanged.
    """

    @jax.jit
    def eval_step(state, batch):
        model, _ = nnx.merge(eval_graphdef, state)
        _, metrics = model_loss(model, batch, task=task, loss_chunk=loss_chunk)
        return metrics

    return eval_step
