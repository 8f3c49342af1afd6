"""Which keys each query may see: one value for every attention mask (after levanter's).

An :class:`AttentionMask` holds the pieces a mask is made of instead of the ``[B, H, T, S]``
array they make, so that each implementation of :func:`flaxformer_lite.ops.dot_product_attention`
takes the pieces it can use as they are (a causal flag, a window, segment ids) and the rest as an
array:

  ``is_causal``      query ``i`` sees keys ``j <= position(i)``.
  ``local_window``   ``(left, right)``: keys at most ``left`` positions before and ``right`` after.
  ``global_tokens``  with a window, the first G positions see and are seen by every position
                     (within causality).
  ``query_offset``   the position of query 0, key ``j`` being at ``j``. ``None``: ``S - T``, the
                     last query aligned with the last key; the implementations take the pieces
                     above only at that alignment. Any other offset (a KV cache's write index,
                     often traced) turns them into ``explicit`` at the cache positions.
  ``query_positions`` int ``[T]``: each query's own position, key ``j`` being at ``j`` (not
                     beside a ``query_offset``), for the queries of a sequence split over devices
                     (:mod:`flaxformer_lite.nn.context_parallel`); "chunked" takes them as
                     they are, the other implementations get them folded into ``explicit``.
  ``segment_ids``    int ``(q [B, T], kv [B, S])``: a query sees only keys with its id (packing).
  ``explicit``       bool, broadcastable to ``[B, H, T, S]``, True = may attend.

The pieces combine by AND. The value is a pytree (its arrays are leaves) and frozen.
"""

from __future__ import annotations

import dataclasses
import functools

import jax

from flaxformer_lite.ops.masks import (
    causal_mask,
    combine_masks,
    global_tokens_mask,
    local_window_mask,
    segment_mask,
)


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["query_offset", "query_positions", "segment_ids", "explicit"],
    meta_fields=["is_causal", "local_window", "global_tokens"],
)
@dataclasses.dataclass(frozen=True)
class AttentionMask:
    """The pieces of an attention mask; see the module docstring for each field."""

    is_causal: bool = False
    local_window: tuple[int, int] | None = None
    global_tokens: int = 0
    query_offset: int | jax.Array | None = None
    query_positions: jax.Array | None = None
    segment_ids: tuple[jax.Array, jax.Array] | None = None
    explicit: jax.Array | None = None

    @classmethod
    def of(
        cls,
        mask: jax.Array | AttentionMask | None,
        is_causal: bool = False,
        local_window: tuple[int, int] | None = None,
        global_tokens: int = 0,
        segment_ids: tuple[jax.Array, jax.Array] | None = None,
    ) -> AttentionMask:
        """The value of ``dot_product_attention``'s mask arguments: ``mask`` itself when it is
        an :class:`AttentionMask` (the other arguments then left at their defaults)."""
        if not isinstance(mask, AttentionMask):
            return cls(
                is_causal, local_window, global_tokens, segment_ids=segment_ids, explicit=mask
            )
        if is_causal or local_window is not None or global_tokens or segment_ids is not None:
            raise ValueError(
                "with an AttentionMask as the mask, give is_causal, local_window, global_tokens "
                "and segment_ids in it, not beside it"
            )
        return mask

    def aligned(self, q_len: int, kv_len: int) -> AttentionMask:
        """This mask with the causal and window pieces at the implementations' alignment: a
        given ``query_offset`` folded into ``explicit`` (:meth:`folded`), and global tokens
        dropped without a window, where they change nothing. ``query_positions`` stay: an
        implementation that takes them gets them, the others the mask :meth:`folded`."""
        if self.query_offset is not None:
            return self.folded(q_len, kv_len)
        global_tokens = int(self.global_tokens) if self.local_window is not None else 0
        return dataclasses.replace(self, global_tokens=global_tokens)

    def folded(self, q_len: int, kv_len: int) -> AttentionMask:
        """This mask with its causal, window and global-token pieces, at their query offset or
        positions, folded into ``explicit`` (``[B | 1, 1, T, S]``); segment ids kept."""
        explicit = combine_masks(self.explicit, self.positional(q_len, kv_len))
        return AttentionMask(segment_ids=self.segment_ids, explicit=explicit)

    def positional(self, q_len: int, kv_len: int) -> jax.Array | None:
        """The causal, window and global-token pieces as a bool ``[1, 1, T, S]`` mask
        (``[B, 1, T, S]`` for a per-row ``query_offset``), or ``None`` if there are none."""
        at = dict(offset=self.query_offset, positions=self.query_positions)
        if self.query_offset is None and self.query_positions is None:
            at["offset"] = kv_len - q_len  # the last query aligned with the last key
        masks = []
        if self.is_causal:
            masks.append(causal_mask(q_len, kv_len, **at))
        if self.local_window is not None:
            window = local_window_mask(q_len, kv_len, self.local_window, **at)
            if self.global_tokens:
                window = window | global_tokens_mask(q_len, kv_len, self.global_tokens, **at)
            masks.append(window)
        return combine_masks(*masks)

    def given(self) -> jax.Array | None:
        """``explicit`` and the mask of the segment ids combined, or ``None``: the pieces an
        implementation that takes no segment ids receives as one array."""
        if self.segment_ids is None:
            return self.explicit
        return combine_masks(self.explicit, segment_mask(*self.segment_ids))

    def dense(self, q_len: int, kv_len: int) -> jax.Array | None:
        """Every piece in one bool mask, broadcastable to ``[B, H, T, S]``, or ``None``."""
        return combine_masks(self.given(), self.positional(q_len, kv_len))
