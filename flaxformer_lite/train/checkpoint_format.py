"""What a checkpoint holds and how it is read back, in one place: the part of a train state it
saves (:func:`saved_part`: all of it, or a LoRA run's adapters without the base, which
:func:`base_record` names instead), that part as plain arrays and back (:func:`to_savable`,
:func:`from_savable`), the target a restore reads into (:func:`restore_target`, each leaf
checked by :func:`abstract_leaf`), and, when a restore fails, how the saved arrays differ from
it (:func:`changed_arrays`: the model changed since, rather than an unreadable checkpoint).
:mod:`.checkpoint` writes and reads the steps.
"""

from __future__ import annotations

import logging
import pathlib
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from flax import nnx

from flaxformer_lite.nn.lora import BASE, has_adapters
from flaxformer_lite.train.fingerprints import fingerprints_of

if TYPE_CHECKING:
    from flaxformer_lite.train.config import TrainConfig

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


def saved_part(state):
    """What a checkpoint holds of a split train state: all of it, or, for a LoRA run, all but
    the base's parameters (made again from ``init_from`` or the seed, named by
    :func:`base_record`)."""
    if not has_adapters(state):
        return state
    return nnx.filter_state(state, nnx.Not(BASE))


def to_savable(state) -> dict:
    """The split state's :func:`saved_part` as a nested dict of plain arrays (typed PRNG keys
    as their key data)."""
    return jax.tree.map(
        lambda x: jax.random.key_data(x) if _is_key(x) else x, nnx.to_pure_dict(saved_part(state))
    )


def from_savable(saved: dict, like):
    """The inverse of :func:`to_savable`, written into the state ``like`` (concrete, or abstract
    as :func:`flaxformer_lite.parallel.abstract_sharded` makes it; a LoRA run's with its base in
    place) and returned."""

    def restore(saved_leaf, like_leaf):
        if not _is_key(like_leaf):
            return saved_leaf
        # An abstract key has no implementation to ask; nnx.Rngs made it with the default one.
        impl = jax.random.key_impl(like_leaf) if isinstance(like_leaf, jax.Array) else None
        return jax.random.wrap_key_data(saved_leaf, impl=impl)

    part = saved_part(like)
    nnx.replace_by_pure_dict(part, jax.tree.map(restore, saved, nnx.to_pure_dict(part)))
    return like if part is like else nnx.merge_state(like, part)


def restore_target(abstract_state) -> dict[str, Any]:
    """What :func:`to_savable` makes of ``abstract_state``, as ``ShapeDtypeStruct``s carrying the
    current shardings: checkpoints restore straight into this layout."""

    def leaf(x):
        if _is_key(x):
            data = jax.eval_shape(jax.random.key_data, x)
            return jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=x.sharding)
        return x

    return jax.tree.map(leaf, nnx.to_pure_dict(saved_part(abstract_state)))


def _is_key(x) -> bool:
    return jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def base_record(cfg: TrainConfig, state) -> dict[str, Any] | None:
    """What names a LoRA run's base in its checkpoints: where it comes from and each
    parameter's fingerprint; None for a run without adapters (its checkpoints hold it all)."""
    if not has_adapters(state[0]):
        return None
    source = f"init_from={cfg.init_from}" if cfg.init_from else f"seed={cfg.seed}"
    return {"source": source, "arrays": fingerprints_of(nnx.to_pure_dict(base_part(state)))}


def check_base(restored, base: dict[str, Any] | None, where) -> None:
    """Refuses adapters restored onto a base other than the one they were trained on.

    Raises:
      ValueError: a parameter of ``base`` whose fingerprint differs from the checkpoint's
        record (naming it and both sources).
    """
    saved = restored.base
    if base is None or saved is None:
        return
    changed = [name for name, value in base["arrays"].items() if saved["arrays"].get(name) != value]
    if changed:
        raise ValueError(
            f"{where} step {restored.step} holds adapters of another base: they were trained "
            f"on {saved['source']}, and {base['source']} differs in {len(changed)} "
            f"parameter(s), e.g. {changed[0]}; give the base they were trained on"
        )


def base_part(state):
    """The base parameters of a train state (every Param but the adapters)."""
    return nnx.filter_state(state[0], BASE)
