"""A config's programs compiled ahead of time for a topology: the train step ``train.py`` runs,
or the generation loop, built from abstract values (``jax.ShapeDtypeStruct``s that carry their
``NamedSharding``s: nothing is allocated) on a mesh over the topology's devices.

    topology = parse_topology("v5e-8")
    program = compile_for(cfg, topology)             # or decode=True
    program.compiled.memory_analysis()

The train step is the training loop's own (:mod:`flaxformer_lite.train.program`): the model
and optimizer of ``build_train_state``, the layout of ``cfg.mesh`` and its rules, dropout on,
traced under the same mesh and rules, for an abstract batch of the config's task with the
arrays the input pipeline makes (:mod:`flaxformer_lite.data.features`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx
from jax.experimental import mesh_utils
from jax.sharding import NamedSharding, PartitionSpec

from flaxformer_lite import parallel
from flaxformer_lite.aot.topology import Topology, topology_devices
from flaxformer_lite.decode import generate, seq2seq_generate
from flaxformer_lite.models import build_model, generation_flops
from flaxformer_lite.ops.attention_choice import recorded_choices
from flaxformer_lite.train.config import TrainConfig
from flaxformer_lite.train.muon import newton_schulz_flops
from flaxformer_lite.train.optim import model_kernels
from flaxformer_lite.train.program import (
    abstract_batch,
    build_train_state,
    configured_train_step,
    flops_per_token,
    resolve_mesh,
    tracing_layout,
)
from flaxformer_lite.train.step_numbers import step_numbers


@dataclasses.dataclass(frozen=True)
class CompiledProgram:
    """A compiled program and what the report needs to read it.

    Attributes:
      name: ``"train step"`` or ``"generation"``.
      compiled: the ``jax.stages.Compiled`` program; None when the compiler refused it for
        want of memory (``out_of_memory`` then holds its message).
      cfg: the config, with the mesh's sizes resolved.
      mesh: the mesh over the topology's devices.
      param_bytes: the parameters' bytes on one device (the largest share).
      optimizer_bytes: the optimizer state's bytes on one device (0 for generation).
      model_flops: the model's FLOPs per run of the program on all chips (the ``6 N`` count of
        :func:`~flaxformer_lite.models.training_flops_per_token`; for generation the forward
        FLOPs of :func:`~flaxformer_lite.models.generation_flops`).
      optimizer_flops: one chip's FLOPs of the optimizer's own matmuls per step (Muon's
        Newton-Schulz: its whole count over the chips each matrix is split over, ``fsdp x
        tensor``; data replicas each orthogonalize every matrix), 0 for AdamW and generation.
      attention: the attention implementation(s) the trace used, joined by ``+``.
      weight_reads: how many times a run reads every weight at least (generation: once per
        new token), for the memory floor of the estimate.
      out_of_memory: the compiler's first line when it ran out of the chip's memory.
    """

    name: str
    compiled: jax.stages.Compiled | None
    cfg: TrainConfig
    mesh: jax.sharding.Mesh
    param_bytes: int
    optimizer_bytes: int
    model_flops: float
    attention: str
    weight_reads: int = 1
    optimizer_flops: float = 0.0
    out_of_memory: str | None = None


def compile_for(
    cfg: TrainConfig, topology: Topology, *, decode: bool = False, max_new_tokens: int = 32
) -> CompiledProgram:
    """Compiles ``cfg``'s train step (or, with ``decode``, its generation of ``max_new_tokens``
    tokens for ``train.batch_size`` prompts of ``data.seq_len`` tokens) for ``topology``.

    Raises:
      TopologyError: libtpu is missing, or too few CPU devices for ``cpu-N``.
      ValueError: a mesh whose sizes do not match the topology's chips, shapes that do not
        divide over it, a batch that does not split over its batch axes, or ``decode`` for a
        model that does not generate or with a context axis.
    """
    if decode and cfg.mesh.context != 1:
        raise ValueError(
            f"--decode with mesh.context={cfg.mesh.context}: generation keeps each sequence's KV "
            "cache on its devices unsplit; compile it with mesh.context=1"
        )
    devices = topology_devices(topology)
    sizes = parallel.mesh_shape(
        cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor, len(devices), context=cfg.mesh.context
    )
    cfg, mesh = resolve_mesh(cfg, _ordered(devices, sizes))
    rules = cfg.mesh.rules
    microbatches = 1 if decode else cfg.train.grad_accum_steps
    parallel.check_batch_size(cfg.train.batch_size, mesh, rules, microbatches)
    build = _generation if decode else _train_step
    program, args, parts, model_flops, weight_reads = build(cfg, mesh, max_new_tokens)
    with tracing_layout(mesh, rules), recorded_choices() as choices:
        lowered = program.lower(*args)
    chosen = "+".join(dict.fromkeys(choice.backend for choice in choices))
    attention = cfg.model.attention_implementation or chosen or "none"
    compiled, out_of_memory = None, None
    try:
        compiled = lowered.compile()
    except jax.errors.JaxRuntimeError as error:  # the TPU compiler checks the chip's memory
        if "RESOURCE_EXHAUSTED" not in str(error):
            raise
        out_of_memory = str(error).splitlines()[0]
    return CompiledProgram(
        name="generation" if decode else "train step",
        compiled=compiled,
        out_of_memory=out_of_memory,
        cfg=cfg,
        mesh=mesh,
        param_bytes=parallel.device_bytes(*parts[0]),
        optimizer_bytes=parallel.device_bytes(*parts[1]) if len(parts) > 1 else 0,
        model_flops=model_flops,
        attention=attention,
        weight_reads=weight_reads,
        optimizer_flops=0.0 if decode else _optimizer_flops(cfg),
    )


def _optimizer_flops(cfg: TrainConfig) -> float:
    """One chip's share of the optimizer's own FLOPs per step (:class:`CompiledProgram`)."""
    flops = newton_schulz_flops(cfg.optimizer, model_kernels(cfg.model))
    return flops / (cfg.mesh.fsdp * cfg.mesh.tensor)


def _ordered(devices: list, sizes: tuple[int, ...]) -> list:
    """``devices`` in the order ``jax.make_mesh`` gives a mesh of ``sizes``: the innermost
    axis on neighbouring chips. CPU devices have no coordinates: kept as they are."""
    if devices[0].platform == "cpu":
        return devices
    grid = mesh_utils.create_device_mesh(sizes, devices, allow_split_physical_axes=True)
    return list(grid.flat)


def _train_step(cfg: TrainConfig, mesh, _max_new_tokens):
    built = build_train_state(cfg, mesh, abstract=True)
    state, shardings = built.state, built.shardings
    step = configured_train_step(cfg, built.graphdef, shardings)
    batch = abstract_batch(cfg, parallel.batch_sharding(mesh, cfg.mesh.rules))
    replicated = NamedSharding(mesh, PartitionSpec())
    numbers = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated),
        step_numbers(cfg, built.schedule),
    )
    active = jax.ShapeDtypeStruct((), jnp.bool_, sharding=replicated)
    params = _params(state[0], shardings[0])
    tokens = cfg.train.batch_size * cfg.data.seq_len
    flops = tokens * flops_per_token(cfg, state)
    return step, (state, batch, numbers, active), (params, (state[1], shardings[1])), flops, 1


def _generation(cfg: TrainConfig, mesh, max_new_tokens: int):
    kind = cfg.model.kind
    if not kind.generates:
        raise ValueError(f"--decode needs a decoder or encoder-decoder model; model.kind is {kind}")

    def create():
        return build_model(cfg.model, rngs=nnx.Rngs(params=cfg.seed, dropout=cfg.seed + 1))

    graphdef, state, shardings = parallel.abstract_sharded(create, mesh, cfg.mesh.rules)
    batch, length = cfg.train.batch_size, cfg.data.seq_len
    prompts = jax.ShapeDtypeStruct(
        (batch, length), jnp.int32, sharding=parallel.batch_sharding(mesh, cfg.mesh.rules)
    )

    @jax.jit
    def run(state, prompts):
        model = nnx.merge(graphdef, state)
        if not kind.is_seq2seq:
            return generate(model, prompts, max_new_tokens=max_new_tokens)
        return seq2seq_generate(model, prompts, max_new_tokens=max_new_tokens)

    flops = batch * generation_flops(cfg.model, length, max_new_tokens)
    return run, (state, prompts), (_params(state, shardings),), flops, max_new_tokens


def _params(state: nnx.State, shardings: nnx.State) -> tuple[nnx.State, nnx.State]:
    """The parameters of a model's ``state`` and their shardings."""
    return nnx.filter_state(state, nnx.Param), nnx.filter_state(shardings, nnx.Param)
