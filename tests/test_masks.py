"""Mask constructors against plain index formulas."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxformer_lite import ops


@pytest.mark.parametrize("q_len, kv_len, offset", [(5, 5, 0), (3, 7, 4), (6, 4, -2), (4, 4, 2)])
def test_causal_mask(q_len, kv_len, offset):
    mask = ops.causal_mask(q_len, kv_len, offset)
    expected = np.array([[j <= i + offset for j in range(kv_len)] for i in range(q_len)])
    assert mask.shape == (1, 1, q_len, kv_len) and mask.dtype == jnp.bool_
    np.testing.assert_array_equal(mask[0, 0], expected)


def test_causal_mask_per_row_offsets_under_jit():
    offsets = jnp.array([0, 3])
    mask = jax.jit(ops.causal_mask, static_argnums=(0, 1))(2, 5, offsets)
    assert mask.shape == (2, 1, 2, 5)
    for row, offset in enumerate([0, 3]):
        np.testing.assert_array_equal(mask[row, 0], ops.causal_mask(2, 5, offset)[0, 0])


def test_local_window_mask():
    mask = ops.local_window_mask(6, 8, (2, 1), offset=2)
    expected = np.array([[i + 2 - 2 <= j <= i + 2 + 1 for j in range(8)] for i in range(6)])
    np.testing.assert_array_equal(mask[0, 0], expected)
    with pytest.raises(ValueError, match="local_window"):
        ops.local_window_mask(4, 4, (1,))


def test_positions_replace_the_offset_and_refuse_one_beside_them():
    """Query positions are absolute: each row is the row of the mask at that position, and an
    offset given beside them (once silently dropped) is an error, for a mask and its pieces."""
    positions = jnp.asarray([6, 1, 4])
    whole = ops.causal_mask(8, 8)[0, 0] & ops.local_window_mask(8, 8, (2, 0))[0, 0]
    rows = ops.causal_mask(3, 8, positions=positions) & ops.local_window_mask(
        3, 8, (2, 0), positions=positions
    )
    np.testing.assert_array_equal(rows[0, 0], whole[np.asarray(positions)])
    for make in (
        lambda **at: ops.causal_mask(3, 8, **at),
        lambda **at: ops.local_window_mask(3, 8, (2, 0), **at),
        lambda **at: ops.global_tokens_mask(3, 8, 1, **at),
    ):
        for offset in (0, 5, jnp.asarray(2)):
            with pytest.raises(ValueError, match="offset and positions are both given"):
                make(offset=offset, positions=positions)
    both = ops.AttentionMask(is_causal=True, query_offset=2, query_positions=positions)
    with pytest.raises(ValueError, match="offset and positions are both given"):
        both.positional(3, 8)


def test_padding_mask_from_bools_and_lengths_agree():
    lengths_q, lengths_kv = jnp.array([3, 1]), jnp.array([2, 4])
    valid_q = jnp.arange(4)[None] < lengths_q[:, None]
    valid_kv = jnp.arange(5)[None] < lengths_kv[:, None]
    from_bools = ops.padding_mask(valid_q, valid_kv)
    from_lengths = ops.padding_mask(lengths_q, lengths_kv, q_len=4, kv_len=5)
    assert from_bools.shape == (2, 1, 4, 5)
    np.testing.assert_array_equal(from_bools, from_lengths)
    expected = np.array(valid_q)[:, None, :, None] & np.array(valid_kv)[:, None, None, :]
    np.testing.assert_array_equal(from_bools, expected)
    self_attention = ops.padding_mask(lengths_q, q_len=4)
    np.testing.assert_array_equal(self_attention, ops.padding_mask(valid_q, valid_q))
    longer_keys = ops.padding_mask(lengths_q, q_len=4, kv_len=6)
    valid_keys = np.arange(6)[None] < np.asarray(lengths_q)[:, None]
    np.testing.assert_array_equal(longer_keys, ops.padding_mask(valid_q, jnp.asarray(valid_keys)))


def test_padding_mask_errors():
    with pytest.raises(ValueError, match="q_len is required"):
        ops.padding_mask(jnp.array([1, 2]), jnp.ones((2, 3), bool))
    with pytest.raises(ValueError, match="batch sizes differ"):
        ops.padding_mask(jnp.ones((2, 3), bool), jnp.ones((3, 3), bool))
    with pytest.raises(ValueError, match="q_valid must be"):
        ops.padding_mask(jnp.ones((2, 3)), jnp.ones((2, 3), bool))
    with pytest.raises(ValueError, match="kv_len=5 contradicts"):
        ops.padding_mask(jnp.ones((2, 3), bool), kv_len=5)
    with pytest.raises(ValueError, match="offset must be"):
        ops.local_window_mask(4, 4, (1, 1), offset=jnp.zeros((2, 3), jnp.int32))


def test_segment_mask():
    q_ids = jnp.array([[1, 1, 2, 2, 0]])
    kv_ids = jnp.array([[1, 2, 2, 3]])
    mask = ops.segment_mask(q_ids, kv_ids)
    expected = np.array([[[[a == b for b in kv_ids[0]] for a in q_ids[0]]]])
    np.testing.assert_array_equal(mask, expected)
    np.testing.assert_array_equal(ops.segment_mask(q_ids), ops.segment_mask(q_ids, q_ids))
    with pytest.raises(ValueError, match="segment ids"):
        ops.segment_mask(jnp.array([1, 2]))


def test_combine_masks():
    a = ops.causal_mask(4)
    b = ops.padding_mask(jnp.array([4, 2]), q_len=4)
    np.testing.assert_array_equal(ops.combine_masks(a, None, b), np.asarray(a) & np.asarray(b))
    assert ops.combine_masks(None, None) is None
    with pytest.raises(ValueError, match="boolean"):
        ops.combine_masks(a, jnp.ones((4, 4)))
    with pytest.raises(ValueError, match="do not broadcast"):
        ops.combine_masks(a, jnp.ones((1, 1, 3, 4), bool))


@pytest.mark.parametrize("offset", [None, 3, jnp.array([0, 4])])
def test_attention_mask_pieces_follow_the_index_formula(offset):
    q_len, kv_len, (left, right), global_tokens = 3, 8, (2, 1), 2
    pieces = ops.AttentionMask(
        is_causal=True,
        local_window=(left, right),
        global_tokens=global_tokens,
        query_offset=offset,
        segment_ids=(jnp.array([[1, 1, 2], [1, 1, 1]]), jnp.array([[1] * 4 + [2] * 4, [1] * 8])),
        explicit=jnp.arange(kv_len) != 6,
    )
    offsets = np.broadcast_to(kv_len - q_len if offset is None else np.asarray(offset), (2,))
    q_ids, kv_ids = (np.asarray(ids) for ids in pieces.segment_ids)
    expected = np.zeros((2, 1, q_len, kv_len), bool)
    for b, i, j in np.ndindex(2, q_len, kv_len):
        position = i + offsets[b]
        window = position - left <= j <= position + right
        window |= j < global_tokens or position < global_tokens
        same_segment = q_ids[b, i] == kv_ids[b, j]
        expected[b, 0, i, j] = window and j <= position and same_segment and j != 6
    dense = np.broadcast_to(pieces.dense(q_len, kv_len), expected.shape)
    np.testing.assert_array_equal(dense, expected)
    aligned = pieces.aligned(q_len, kv_len)
    # The implementations take the pieces at the S - T alignment only: any other offset
    # becomes part of the explicit mask.
    assert aligned.is_causal == (offset is None) and aligned.query_offset is None
    np.testing.assert_array_equal(np.broadcast_to(aligned.dense(q_len, kv_len), dense.shape), dense)


def test_attention_mask_without_a_window_drops_its_global_tokens():
    aligned = ops.AttentionMask(is_causal=True, global_tokens=3).aligned(4, 4)
    assert aligned == ops.AttentionMask(is_causal=True)
