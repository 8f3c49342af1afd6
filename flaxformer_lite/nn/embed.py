"""Token embeddings, with ``attend`` for an output projection tied to the same table."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from flaxformer_lite.nn.dense import XAVIER, KernelInit, param
from flaxformer_lite.nn.parametrization import role_of
from flaxformer_lite.nn.sharding import gathered_for_compute
from flaxformer_lite.ops.projection import project


class Embed(nnx.Module):
    """A lookup table ``[num_embeddings, features]``.

    Args:
      num_embeddings: vocabulary (or position, or token-type) count.
      features: embedding size D.
      names: logical axis names of the table, ``("vocab", "embed")`` for tokens.
      init: a :class:`KernelInit` (its ``embedding`` initializer, for the table's role: ``input``
        when its features grow with the width).
      dtype: compute dtype of the outputs; param_dtype: storage dtype.
    """

    def __init__(
        self,
        num_embeddings: int,
        features: int,
        *,
        names: tuple = ("vocab", "embed"),
        init: KernelInit = XAVIER,
        dtype=jnp.float32,
        param_dtype=jnp.float32,
        rngs: nnx.Rngs,
    ):
        self.dtype = dtype
        shape = (num_embeddings, features)
        self.role = role_of(names, 1, init.growing)  # "input" for a table of the width
        table_init = init.for_role(self.role).embedding(features)
        self.embedding = param(rngs, table_init, shape, names, param_dtype)

    def __call__(self, ids: jax.Array) -> jax.Array:
        """``[...]`` int ids -> ``[..., D]`` in the compute dtype.

        Raises:
          ValueError: non-integer ids.
        """
        if not jnp.issubdtype(jnp.asarray(ids).dtype, jnp.integer):
            raise ValueError(f"Embed expects integer ids, got dtype {jnp.asarray(ids).dtype}")
        # The table without its FSDP split (its "embed" dimension): the rows come out whole, in
        # the batch's layout; from the split table XLA would move each looked-up row from a
        # D-split to a batch-split layout by replicating it ("involuntary rematerialization").
        table = gathered_for_compute(self.embedding[...], self.embedding.out_sharding)
        return jnp.take(table, ids, axis=0).astype(self.dtype)

    def attend(self, x: jax.Array) -> jax.Array:
        """The tied output projection: ``[..., D] -> [..., num_embeddings]`` logits ``x @ E^T``.

        Through :func:`~flaxformer_lite.ops.project`, whose backward pass transposes ``x [T, D]``
        rather than the logits' gradient ``[T, V]`` to form the table's gradient.
        """
        return project(x.astype(self.dtype), self.embedding[...].astype(self.dtype).T)
