"""The target of a checkpoint restore (:mod:`flaxformer_lite.train.checkpoint`'s restore): the
pytree of ``jax.ShapeDtypeStruct`` leaves the arrays are read into, each checked to carry a
sharding on real devices (:func:`abstract_leaf`), and, when a restore fails, how the checkpoint's
arrays differ from it in shape or name (:func:`changed_arrays`: the model changed since the
checkpoint was saved, ``CheckpointShapeError``, rather than an unreadable checkpoint).
"""

from __future__ import annotations

import logging
import pathlib
from typing import Any

import jax
import orbax.checkpoint as ocp

# The records of the checkpoint module, whose restores these checks are part of.
logger = logging.getLogger("flaxformer_lite.train.checkpoint")


def abstract_leaf(path, leaf) -> jax.ShapeDtypeStruct:
    """A leaf of a restore target, checked to carry a sharding on real devices."""
    where = f"abstract_state{jax.tree_util.keystr(path)}"
    if isinstance(leaf, jax.Array):
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=leaf.sharding)
    if not isinstance(leaf, jax.ShapeDtypeStruct):
        raise ValueError(f"{where} must be a jax.ShapeDtypeStruct or jax.Array, got {leaf!r}")
    sharding = leaf.sharding
    if sharding is None:
        raise ValueError(
            f"{where} has no sharding; give it the sharding to restore onto "
            "(restoring never falls back to the device layout the checkpoint was saved from)"
        )
    if isinstance(sharding, jax.sharding.NamedSharding) and isinstance(
        sharding.mesh, jax.sharding.AbstractMesh
    ):
        raise ValueError(
            f"{where} is sharded over an AbstractMesh (as jax.eval_shape returns); use a "
            f"NamedSharding on a concrete mesh, e.g. jax.make_mesh(...), spec {sharding.spec}"
        )
    return leaf


def changed_arrays(step_dir: pathlib.Path, target: Any) -> str | None:
    """How the arrays saved in ``step_dir`` differ from ``target``'s in shape or name, or None
    if they do not, or if the checkpoint's metadata cannot be read (an unreadable one)."""
    try:
        metadata = ocp.StandardCheckpointHandler().metadata(step_dir / "state")
        saved = {_names(path): leaf.shape for path, leaf in _flat(metadata)}
    except Exception as error:  # orbax and TensorStore raise many types
        logger.debug("metadata of %s", step_dir, exc_info=error)
        return None
    wanted = {_names(path): leaf for path, leaf in _flat(target)}
    changes = [
        f"{'/'.join(name)} has shape {tuple(saved[name])} there, {leaf.shape} here"
        for name, leaf in wanted.items()
        if name in saved
        and tuple(saved[name]) != leaf.shape
        and not jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key)  # saved as key data
    ]
    changes += [f"{'/'.join(name)} is not there" for name in wanted if name not in saved]
    changes += [f"{'/'.join(name)} is not in this model" for name in saved if name not in wanted]
    if not changes:
        return None
    more = f" ({len(changes)} arrays differ)" if len(changes) > 1 else ""
    return f"{changes[0]}{more}"


def _flat(tree: Any) -> list:
    return jax.tree_util.tree_flatten_with_path(tree)[0]


def _names(path: tuple) -> tuple[str, ...]:
    """A key path as names, whatever the key types (orbax's metadata has its own)."""
    return tuple(
        str(next(getattr(key, a) for a in ("key", "idx", "name") if hasattr(key, a)))
        for key in path
    )
