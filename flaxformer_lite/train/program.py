"""The pieces of a run's train step that the training loop and ahead-of-time compilation
(:mod:`flaxformer_lite.aot`) share, so that both build and trace the very same program."""

from __future__ import annotations

import contextlib
import dataclasses

import jax
from flax import nnx

from flaxformer_lite import parallel
from flaxformer_lite.train.config import TrainConfig
from flaxformer_lite.train.step import make_train_step, task_of


def resolve_mesh(cfg: TrainConfig, devices=None) -> tuple[TrainConfig, jax.sharding.Mesh]:
    """The mesh of ``cfg.mesh`` over ``devices`` (default: all devices of all processes), and
    ``cfg`` with the mesh's sizes in place of a ``-1``.

    Raises:
      ValueError: sizes that do not fit the devices.
    """
    mesh = parallel.make_mesh(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor, devices=devices)
    data_size, fsdp_size, tensor_size = mesh.shape.values()
    sizes = dict(data=data_size, fsdp=fsdp_size, tensor=tensor_size)
    return dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, **sizes)), mesh


def configured_train_step(cfg: TrainConfig, graphdef, shardings):
    """The jitted train step of ``cfg`` (its task, loss settings and microbatches) for the
    state of ``graphdef`` laid out by ``shardings``."""
    return make_train_step(
        graphdef,
        task=task_of(cfg.model),
        label_smoothing=cfg.train.label_smoothing,
        z_loss=cfg.train.z_loss,
        grad_accum_steps=cfg.train.grad_accum_steps,
        state_shardings=shardings,
    )


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
