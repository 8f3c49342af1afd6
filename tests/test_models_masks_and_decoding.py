"""flaxformer_lite.models, what the attention masks and the KV cache must keep: causality,
position schemes, incremental and ragged decoding against the full forward pass, packed
sequences, and padding invariance of the three architectures, on tiny models (``tiny_models.py``).
"""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from tiny_models import (
    VOCAB,
    B,
    T,
    assert_close,
    check_causal,
    ed_decode_step,
    ed_encode,
    ed_forward,
    enc_forward,
    lengths_mask,
    lm_decode,
    lm_forward,
    make,
    max_diff,
    perturb,
    tiny,
    tokens,
)

from flaxformer_lite import ops

pytestmark = pytest.mark.fast_compile  # XLA's backend optimizations off: conftest.py


# ------------------------------------------------------------------ property checks


def check_position_shift(model, x, absolute):
    """Shifting every position by 3 changes the logits of absolute schemes (sinusoidal, learned)
    and leaves relative ones (rope, relative buckets, alibi, none) unchanged."""
    ones = jnp.ones((B, T), jnp.int32)  # one segment: the same program as check_packing's
    base = lm_forward(model, x, jnp.arange(T)[None].repeat(B, 0), ones)
    shifted = lm_forward(model, x, 3 + jnp.arange(T)[None].repeat(B, 0), ones)
    if absolute:
        assert (max_diff(shifted, base, axis=(0, 2)) > 1e-6).all()
    else:
        assert_close(shifted, base, atol=1e-4)


def check_incremental_decoding(model, x, full, prefix=4):
    """A prefix, then one token at a time through the KV cache == the full forward pass."""
    model.init_cache(B, 16)
    steps = [lm_decode(model, x[:, :prefix])]
    steps += [lm_decode(model, x[:, i : i + 1]) for i in range(prefix, x.shape[1])]
    assert_close(jnp.concatenate(steps, axis=1), full, atol=1e-5)


def check_ragged_decoding(model, x, full, prompt_lengths=(5, 2), width=5):
    """Left-padded prompts with a padding mask and per-row positions, then per-row steps:
    each row's logits equal its own unpadded forward pass (``full``, row ``r`` from position 0;
    causality keeps the tokens after a row's end out of its logits)."""
    lengths = np.asarray(prompt_lengths)
    x, full = np.asarray(x), np.asarray(full)
    prompt = np.zeros((B, width), np.int32)
    positions = np.zeros((B, width), np.int32)
    for row, n in enumerate(lengths):
        prompt[row, width - n :] = x[row, :n]
        positions[row, width - n :] = np.arange(n)
    mask = jnp.asarray(np.arange(width)[None] >= width - lengths[:, None])
    model.init_cache(B, 16)
    out = np.asarray(lm_decode(model, jnp.asarray(prompt), jnp.asarray(positions), mask))
    for row, n in enumerate(lengths):
        assert_close(out[row, width - n :], full[row, :n])
    ones = jnp.ones((B, 1), bool)
    for step in range(x.shape[1] - lengths.max()):
        index = lengths + step
        token = jnp.asarray(x[np.arange(B), index][:, None])
        out = np.asarray(lm_decode(model, token, jnp.asarray(index[:, None]), ones))
        for row in range(B):
            assert_close(out[row, 0], full[row, index[row]])


def check_packing(model, x, packing=((3, 5), (2, 4, 2))):
    """Packed segments (segment ids, positions restarting at 0) == each segment run alone."""
    x = np.asarray(x)
    segment_ids = np.zeros((B, T), np.int32)
    positions = np.zeros((B, T), np.int32)
    alone, spans = [], []
    for row, sizes in enumerate(packing):
        start = 0
        for segment, size in enumerate(sizes):
            segment_ids[row, start : start + size] = segment + 1
            positions[row, start : start + size] = np.arange(size)
            # The segment alone at the start of a row, right-filled (causality: filler unseen).
            alone.append(np.concatenate([x[row, start : start + size], np.full(T - size, 7)]))
            spans.append((row, start, size))
            start += size
    packed = np.asarray(
        lm_forward(model, jnp.asarray(x), jnp.asarray(positions), jnp.asarray(segment_ids))
    )
    alone += [alone[-1]] * (-len(alone) % B)
    separate = np.concatenate(
        [
            np.asarray(lm_forward(model, jnp.asarray(np.stack(alone[i : i + B]), jnp.int32)))
            for i in range(0, len(alone), B)
        ]
    )
    for i, (row, start, size) in enumerate(spans):
        assert_close(packed[row, start : start + size], separate[i, :size])


# ------------------------------------------------------------------ DecoderLM: causality, cache

ALL_CHECKS = ("cache", "ragged", "packing")


@pytest.mark.parametrize(
    "preset, overrides, checks",
    [
        ("gpt2-tiny", dict(positions="sinusoidal"), ("packing",)),
        ("gpt2-tiny", dict(positions="learned"), ALL_CHECKS),
        ("llama-tiny", dict(positions="rope"), ALL_CHECKS),  # GQA: 4 query heads, 2 kv heads
        ("gpt2-tiny", dict(positions="relative"), ALL_CHECKS),
        ("gpt2-tiny", dict(positions="alibi"), ALL_CHECKS),
        ("gpt2-tiny", dict(positions="none"), ("packing",)),
        ("gpt2-tiny", dict(positions="learned", scan_layers=True), ("cache", "ragged")),
        # Global tokens are the first slots of a row: not those of a packed or left-padded one.
        ("llama-tiny", dict(positions="rope", local_window=(3, 0), global_tokens=2), ("cache",)),
    ],
    ids=[
        "sinusoidal",
        "learned",
        "rope-gqa",
        "relative",
        "alibi",
        "none",
        "learned-scan",
        "local-global",
    ],
)
def test_decoder_lm_causality_cache_and_packing(preset, overrides, checks):
    cfg = tiny(preset, **overrides)
    if preset == "llama-tiny":
        assert cfg.num_kv_heads < cfg.num_heads
    model = make(cfg)
    x = tokens((B, T))
    full = lm_forward(model, x)
    assert full.shape == (B, T, VOCAB)

    def forward(inputs):
        return lm_forward(model, inputs)

    check_causal(forward, x)
    if "packing" in checks:  # before init_cache, which changes the graph (a recompile)
        check_packing(model, x)
        check_position_shift(model, x, absolute=cfg.positions in ("sinusoidal", "learned"))
    if "cache" in checks:
        check_incremental_decoding(model, x, full)
    if "ragged" in checks:
        check_ragged_decoding(model, x, full)


# ------------------------------------------------------------------ EncoderDecoder


@pytest.mark.parametrize("positions, scan", [("sinusoidal", False), ("relative", True)])
def test_encoder_decoder_causality_and_decoding(positions, scan):
    model = make(tiny("transformer-tiny", positions=positions, scan_layers=scan))
    src, tgt = tokens((B, T + 1), seed=3), tokens((B, T))
    src_mask = lengths_mask([T + 1, 4], T + 1)
    full = ed_forward(model, src, tgt, src_mask)
    assert full.shape == (B, T, VOCAB)
    check_causal(lambda t: ed_forward(model, src, t, src_mask), tgt)

    encoded = ed_encode(model, src, src_mask)
    model.init_cache(B, T)
    steps = [ed_decode_step(model, tgt[:, i : i + 1], encoded, src_mask) for i in range(T)]
    assert_close(jnp.concatenate(steps, axis=1), full, atol=1e-5)


def test_encoder_decoder_ignores_padded_source():
    model = make(tiny("transformer-tiny"))
    src, tgt, lengths = np.asarray(tokens((B, T + 1), seed=3)), tokens((B, T)), [T + 1, 4]
    src_mask = lengths_mask(lengths, T + 1)
    base = np.asarray(ed_forward(model, jnp.asarray(src), tgt, src_mask))

    other = src.copy()
    other[1, 4:] = (other[1, 4:] + 9) % VOCAB
    assert_close(ed_forward(model, jnp.asarray(other), tgt, src_mask), base)

    longer = np.concatenate([src, np.full((B, 3), 1)], axis=1)
    assert_close(ed_forward(model, jnp.asarray(longer), tgt, lengths_mask(lengths, T + 4)), base)

    # ... while a real source token reaches every target position.
    out = ed_forward(model, perturb(src, 2), tgt, src_mask)
    assert (max_diff(out, base, axis=(0, 2)) > 1e-6).all()


def test_decoding_past_the_cache_gives_nan_not_wrong_numbers():
    model = make(tiny("gpt2-tiny"))
    model.init_cache(B, 6)
    x = tokens((B, T))
    assert np.isfinite(np.asarray(lm_decode(model, x[:, :4]))).all()
    assert np.isnan(np.asarray(lm_decode(model, x[:, 4:7]))).all()  # slots 4..6 of 0..5


def test_encoder_decoder_target_longer_than_source_without_mask():
    model = make(tiny("transformer-tiny"))
    out = ed_forward(model, tokens((B, 3)), tokens((B, 5)))
    assert out.shape == (B, 5, VOCAB)


# ------------------------------------------------------------------ Encoder padding


@pytest.mark.parametrize("positions", ["learned", "relative", "alibi"])
def test_encoder_ignores_padding(positions):
    model = make(tiny("bert-tiny", positions=positions))
    toks, lengths = np.asarray(tokens((B, T))), [T, 5]
    mask = lengths_mask(lengths, T)
    base = np.asarray(enc_forward(model, jnp.asarray(toks), mask))
    assert base.shape == (B, T, VOCAB)

    other = toks.copy()
    other[1, 5:] = (other[1, 5:] + 7) % VOCAB  # padding ids change
    out = np.asarray(enc_forward(model, jnp.asarray(other), mask))
    for row, n in enumerate(lengths):
        assert_close(out[row, :n], base[row, :n])

    longer = np.concatenate([toks, np.full((B, 3), 5)], axis=1)  # three more padded positions
    out = np.asarray(enc_forward(model, jnp.asarray(longer), lengths_mask(lengths, T + 3)))
    for row, n in enumerate(lengths):
        assert_close(out[row, :n], base[row, :n])

    # ... while a real token is seen by every real position (bidirectional attention).
    out = np.asarray(enc_forward(model, perturb(toks, 3), mask))
    for row, n in enumerate(lengths):
        assert (max_diff(out[row, :n], base[row, :n], axis=-1) > 1e-6).all()


# ------------------------------------------------------------------ Segment ids reach the attention

# Row 0: two segments and a padding position (id 0); row 1: three segments.
PACKED_IDS = jnp.asarray([[1, 1, 1, 2, 2, 2, 2, 0], [1, 1, 2, 2, 3, 3, 3, 3]], jnp.int32)


@pytest.mark.parametrize("preset", ["gpt2-tiny", "llama-tiny", "bert-tiny"])
def test_segment_ids_reach_the_attention_as_ids_and_equal_the_bool_mask(preset, monkeypatch):
    cfg = tiny(preset, attention_implementation="xla")
    model = make(cfg)
    inputs = dict(segment_ids=PACKED_IDS, padding_mask=lengths_mask([T, 7], T))
    x = tokens((B, T))
    calls = []
    attention = ops.dot_product_attention

    def spy(query, key, value, bias, mask, **kwargs):
        calls.append((mask.explicit, mask.segment_ids))
        return attention(query, key, value, bias, mask, **kwargs)

    def mask_only(query, key, value, bias, mask, **kwargs):
        """The segment ids folded into the bool mask."""
        explicit = ops.combine_masks(mask.explicit, ops.segment_mask(*mask.segment_ids))
        mask = dataclasses.replace(mask, segment_ids=None, explicit=explicit)
        return attention(query, key, value, bias, mask, **kwargs)

    monkeypatch.setattr(ops, "dot_product_attention", spy)
    out = model(x, **inputs)
    monkeypatch.setattr(ops, "dot_product_attention", mask_only)
    with_mask = model(x, **inputs)
    monkeypatch.undo()
    # Every layer got the ids as a pair and a key padding mask, not a [B, 1, T, T] mask.
    assert len(calls) == cfg.num_encoder_layers + cfg.num_decoder_layers
    for mask, (q_ids, kv_ids) in calls:
        assert mask.shape == (B, 1, 1, T)
        np.testing.assert_array_equal(q_ids, PACKED_IDS)
        np.testing.assert_array_equal(kv_ids, PACKED_IDS)
    assert_close(out, with_mask, atol=1e-6, rtol=1e-6)


def test_segment_ids_are_refused_where_they_have_no_meaning():
    model = make(tiny("gpt2-tiny"))
    model.init_cache(B, 16)
    with pytest.raises(ValueError, match="segment_ids"):
        model(tokens((B, T)), segment_ids=PACKED_IDS, decode=True)
    attention = model.decoder.layers.layers[0].self_attention
    with pytest.raises(ValueError, match="segment_ids are for self-attention without a KV cache"):
        attention(jnp.zeros((B, T, 32)), segment_ids=PACKED_IDS, cache_index=jnp.asarray(0))
