"""Creating a model and its optimizer directly in their shards.

    graphdef, state, shardings = create_sharded(lambda: make(model_cfg), mesh, rules)

``create`` is traced once with abstract values (``nnx.eval_shape``: no memory), the logical
names its parameters carry give each array a ``NamedSharding``, and ``jax.jit`` with those
``out_shardings`` runs the initializers so that every device computes only its own shard:
nothing is materialized whole on one device. Random initializers give the same values on any
mesh (JAX's partitionable threefry), so a run initializes identically on 1 or 1000 devices.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from flax import nnx
from jax.sharding import Mesh

from flaxformer_lite.parallel.rules import Rules, state_shardings


def create_sharded(create: Callable[[], object], mesh: Mesh, rules: Rules):
    """``(graphdef, state, shardings)`` of the NNX object(s) ``create()`` returns, with ``state``
    created on the devices of ``mesh`` in the layout ``rules`` give (``shardings``, an
    ``nnx.State`` of ``NamedSharding`` mirroring ``state``).

    Raises:
      ValueError: a parameter dimension that does not divide over its mesh axes.
    """
    graphdef, abstract_state = nnx.split(nnx.eval_shape(create))
    shardings = state_shardings(abstract_state, mesh, rules)

    def init():
        return nnx.split(create())[1]

    state = jax.jit(init, out_shardings=shardings)()
    return graphdef, state, shardings


def abstract_sharded(create: Callable[[], object], mesh: Mesh, rules: Rules):
    """``(graphdef, state, shardings)`` like :func:`create_sharded`, with ``state`` holding
    ``jax.ShapeDtypeStruct``s that carry their shardings: for restoring a checkpoint straight
    into its shards, measuring memory, or compiling ahead of time without any allocation."""
    graphdef, abstract_state = nnx.split(nnx.eval_shape(create))
    shardings = state_shardings(abstract_state, mesh, rules)
    state = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract_state, shardings
    )
    return graphdef, state, shardings
