"""Creating a model and its optimizer directly in their shards.

    graphdef, state, shardings = create_sharded(lambda: make(model_cfg), mesh, rules)

``create`` is traced once with abstract values (``nnx.eval_shape``: no memory), the logical
names its parameters carry give each array a ``NamedSharding``, and ``jax.jit`` with those
``out_shardings`` runs the initializers so that every device computes only its own shard:
nothing is materialized whole on one device. Random initializers give the same values on any
mesh (JAX's partitionable threefry), so a run initializes identically on 1 or 1000 devices.
"""

from __future__ import annotations

import collections
from collections.abc import Callable

import jax
from flax import nnx
from jax.sharding import Mesh

from flaxformer_lite.parallel.rules import Rules, state_shardings

# The initializers compiled last, by their lowered program: objects created alike but for their
# arguments (a sweep's members, by seed) compile their initializer once.
_COMPILED: collections.OrderedDict[str, object] = collections.OrderedDict()
_KEPT = 8


def create_sharded(create: Callable[..., object], mesh: Mesh, rules: Rules, *args):
    """``(graphdef, state, shardings)`` of the NNX object(s) ``create(*args)`` returns, with
    ``state`` created on the devices of ``mesh`` in the layout ``rules`` give (``shardings``, an
    ``nnx.State`` of ``NamedSharding`` mirroring ``state``). ``args`` (arrays, such as a seed)
    are arguments of the compiled initializer, not constants in it.

    Raises:
      ValueError: a parameter dimension that does not divide over its mesh axes.
    """
    graphdef, abstract_state = nnx.split(nnx.eval_shape(create, *args))
    shardings = state_shardings(abstract_state, mesh, rules)

    def init(*args):
        return nnx.split(create(*args))[1]

    lowered = jax.jit(init, out_shardings=shardings).lower(*args)
    program = lowered.as_text()
    if program not in _COMPILED:
        _COMPILED[program] = lowered.compile()
        if len(_COMPILED) > _KEPT:
            _COMPILED.popitem(last=False)
    _COMPILED.move_to_end(program)
    return graphdef, _COMPILED[program](*args), shardings


def abstract_sharded(create: Callable[..., object], mesh: Mesh, rules: Rules, *args):
    """``(graphdef, state, shardings)`` like :func:`create_sharded`, with ``state`` holding
    ``jax.ShapeDtypeStruct``s that carry their shardings: for restoring a checkpoint straight
    into its shards, measuring memory, or compiling ahead of time without any allocation."""
    graphdef, abstract_state = nnx.split(nnx.eval_shape(create, *args))
    shardings = state_shardings(abstract_state, mesh, rules)
    state = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract_state, shardings
    )
    return graphdef, state, shardings
