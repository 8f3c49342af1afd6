"""A fingerprint of each array of a checkpoint, saved with it and checked after a restore:
Orbax checksums its metadata but not array data, so damaged bytes of the right size would
otherwise restore as if they were good.

A fingerprint is a uint32 computed on the array's own devices, the same however the array is
sharded, so a checkpoint restored onto another mesh is checked too.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

ALGORITHM = "uint32 sum of words x (2 index + 1)"


class DamagedArrayError(ValueError):
    """A restored array differs from the fingerprint recorded when it was saved."""


def fingerprints_of(tree: Any) -> dict[str, list]:
    """``[dtype, fingerprint]`` of each array of ``tree``, by its key path (``None`` for a dtype
    that has no fingerprint): one jitted program per set of devices, whose result is a few
    bytes fetched from them."""
    arrays = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if jax.dtypes.issubdtype(getattr(leaf, "dtype", None), jax.dtypes.prng_key):
            leaf = jax.random.key_data(leaf)
        elif not isinstance(leaf, jax.Array):
            leaf = np.asarray(leaf)
        arrays[jax.tree_util.keystr(path)] = leaf
    groups: dict[Any, list[str]] = {}
    for name, array in arrays.items():
        if _words_dtype(array.dtype) is not None:
            devices = array.sharding.device_set if isinstance(array, jax.Array) else None
            groups.setdefault(None if devices is None else frozenset(devices), []).append(name)
    values = {}
    for names in groups.values():
        sums = np.asarray(_fingerprint_arrays([arrays[name] for name in names]))
        values.update(zip(names, (int(value) for value in sums), strict=True))
    return {name: [str(array.dtype), values.get(name)] for name, array in arrays.items()}


def _words_dtype(dtype) -> Any:
    """The unsigned dtype an array of ``dtype`` is read as (bitcast) to fingerprint it, or
    None (complex, 4-bit: never in a train state)."""
    if dtype == np.bool_:
        return jnp.uint8
    if jnp.issubdtype(dtype, jnp.integer):
        bits = jnp.iinfo(dtype).bits
    elif jnp.issubdtype(dtype, jnp.floating):
        bits = jnp.finfo(dtype).bits
    else:
        return None
    return {8: jnp.uint8, 16: jnp.uint16, 32: jnp.uint32, 64: jnp.uint32}.get(bits)


@jax.jit
def _fingerprint_arrays(arrays: list[jax.Array]) -> jax.Array:
    """One uint32 per array: the sum of its words (bitcast) times their odd position weights
    ``2 i + 1``, modulo 2^32. Integer sums do not depend on the order of their terms, so the
    value is the same however the array is sharded; an odd weight makes any one changed word
    change it, and the position, words moved."""
    sums = []
    for array in arrays:
        words = array.astype(jnp.uint8) if array.dtype == jnp.bool_ else array
        words = jax.lax.bitcast_convert_type(words, _words_dtype(array.dtype))
        words = words.astype(jnp.uint32)  # an 8-byte dtype gained a last axis of 2 words
        index, stride = jnp.zeros((), jnp.uint32), 1
        for axis in reversed(range(words.ndim)):
            iota = jax.lax.broadcasted_iota(jnp.uint32, words.shape, axis)
            index, stride = index + iota * jnp.uint32(stride % 2**32), stride * words.shape[axis]
        sums.append(jnp.sum(words * (2 * index + 1), dtype=jnp.uint32))
    return jnp.stack(sums)


def verify(state: Any, saved: Mapping[str, Any]) -> None:
    """Raises :class:`DamagedArrayError` if an array of the restored ``state`` differs from the
    fingerprint saved with it (arrays restored to another dtype are not checked)."""
    if saved.get("algorithm") != ALGORITHM:
        return  # written by another version: nothing to compare with
    expected = saved["arrays"]
    restored = fingerprints_of(state)
    damaged = [
        name
        for name, (dtype, value) in restored.items()
        if name in expected and expected[name][0] == dtype and expected[name][1] != value
    ]
    if damaged:
        raise DamagedArrayError(
            f"the data of {len(damaged)} array(s) differ from the fingerprints saved with "
            f"them, e.g. state{damaged[0]}"
        )
