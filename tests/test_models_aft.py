"""``model.mixer``: the Attention Free Transformer in place of self-attention, in every model."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from tiny_models import (
    B,
    T,
    adam,
    assert_close,
    check_causal,
    ed_forward,
    enc_forward,
    lm_decode,
    lm_forward,
    lm_train_step,
    make,
    tiny,
    tokens,
)

from flaxformer_lite.decode import generate
from flaxformer_lite.interop import save_hf
from flaxformer_lite.models import ModelConfig
from flaxformer_lite.nn import MultiHeadAttention
from flaxformer_lite.nn.attention_free import AttentionFree

pytestmark = pytest.mark.fast_compile

AFT = {
    "aft_full": dict(mixer="aft_full"),
    "aft_local": dict(mixer="aft_local", aft_window=3),
    "aft_simple": dict(mixer="aft_simple"),
}


def aft_model(name, preset="gpt2-tiny", *, scale=1.0, **overrides):
    """A tiny model with the AFT mixer ``name``; its pairwise bias drawn at random (it starts at
    0) and all parameters times ``scale``, so that positions matter and outputs vary."""
    model = make(tiny(preset, **AFT[name], **overrides))
    params = nnx.state(model, nnx.Param)
    keys = iter(jax.random.split(jax.random.key(3), len(jax.tree.leaves(params))))

    def draw(path, x):
        if "pairwise_bias" in jax.tree_util.keystr(path):
            return jax.random.normal(next(keys), x.shape, x.dtype)
        return x * scale

    nnx.update(model, jax.tree.map_with_path(draw, params))
    return model


def self_and_cross(model):
    layer = next(iter(model.decoder.layers.layers))
    return layer.self_attention, layer.cross_attention


@pytest.mark.parametrize("name", list(AFT))
def test_decoder_lm_mixes_causally(name):
    model = aft_model(name)
    assert isinstance(self_and_cross(model)[0], AttentionFree)
    check_causal(lambda x: lm_forward(model, x), tokens((B, T)))


@pytest.mark.parametrize("name", list(AFT))
def test_encoder_mixes_every_position_and_drops_padding(name):
    model = aft_model(name, "bert-tiny")
    x = tokens((B, T))
    out = enc_forward(model, x)
    changed = enc_forward(model, x.at[:, -1].set((x[:, -1] + 1) % 64))
    assert (np.abs(np.asarray(changed - out))[:, 0] > 1e-6).any(), "the last token is not seen"
    padding = jnp.asarray(np.arange(T)[None, :] < np.array([[T], [5]]))
    padded = enc_forward(model, x, padding)
    changed = enc_forward(model, x.at[1, 6].set((x[1, 6] + 1) % 64), padding)
    assert_close(changed[1, :5], padded[1, :5], atol=1e-6, rtol=0)


@pytest.mark.parametrize("name", list(AFT))
def test_encoder_decoder_cross_attention_stays_attention(name):
    model = aft_model(name, "transformer-tiny")
    self_mixer, cross = self_and_cross(model)
    assert isinstance(self_mixer, AttentionFree) and isinstance(cross, MultiHeadAttention)
    assert isinstance(next(iter(model.encoder.layers.layers)).self_attention, AttentionFree)
    out = ed_forward(model, tokens((B, T)), tokens((B, T), seed=1))
    assert np.isfinite(np.asarray(out)).all()


def test_new_parameters_have_logical_axis_names():
    model = aft_model("aft_full")
    mixer = self_and_cross(model)[0]
    names = {
        "/".join(map(str, path)): variable.get_metadata()["out_sharding"]
        for path, variable in nnx.to_flat_state(nnx.state(mixer, nnx.Param))
    }
    assert names["pairwise_bias"] == ("aft_query_length", "aft_key_length")
    assert names["query/kernel"] == ("embed", "aft_features")
    assert names["out/kernel"] == ("aft_features", "embed")
    assert "pairwise_bias" not in {
        "/".join(map(str, p))
        for p, _ in nnx.to_flat_state(nnx.state(self_and_cross(aft_model("aft_simple"))[0]))
    }


@pytest.mark.parametrize("scan", [False, True], ids=["loop", "scan"])
@pytest.mark.parametrize("name", list(AFT))
def test_decoding_token_by_token_equals_the_full_forward(name, scan):
    model = aft_model(name, scan_layers=scan)
    x = tokens((B, T))
    full = lm_forward(model, x)
    model.init_cache(B, T + 2)
    pieces = [lm_decode(model, x[:, :3])]
    pieces += [lm_decode(model, x[:, i : i + 1]) for i in range(3, T)]
    assert_close(jnp.concatenate(pieces, axis=1), full, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("name", list(AFT))
def test_packed_rows_equal_their_documents_alone(name):
    model = aft_model(name)
    first, second = tokens((1, 5)), tokens((1, 3), seed=4)
    packed = jnp.concatenate([first, second], axis=1)
    segments = jnp.asarray([[1] * 5 + [2] * 3])
    positions = jnp.asarray([[0, 1, 2, 3, 4, 0, 1, 2]])
    out = lm_forward(model, packed, positions, segments)
    assert_close(out[:, :5], lm_forward(model, first), atol=2e-5, rtol=2e-5)
    assert_close(out[:, 5:], lm_forward(model, second), atol=2e-5, rtol=2e-5)


def greedy_by_full_forward(model, prompt, new_tokens):
    row = list(prompt)
    for _ in range(new_tokens):
        logits = lm_forward(model, jnp.asarray([row], jnp.int32))[0, -1]
        top2 = np.sort(np.asarray(logits))[-2:]
        assert top2[1] - top2[0] > 1e-4, "a near-tie would make the comparison fragile"
        row.append(int(np.argmax(logits)))
    return row


@pytest.mark.parametrize("name", list(AFT))
def test_generate_equals_greedy_full_recomputation(name):
    model = aft_model(name, scale=3.0)
    prompts = np.asarray(tokens((2, 5), seed=5))
    lengths = np.array([5, 3])
    new = 6
    out = np.asarray(generate(model, prompts, max_new_tokens=new, prompt_lengths=lengths))
    for b, n in enumerate(lengths):
        want = greedy_by_full_forward(model, prompts[b, :n], new)
        np.testing.assert_array_equal(out[b, : n + new], want)
    assert len(set(out[0, 5:].tolist())) >= 2, "a degenerate continuation checks little"


def test_aft_simple_decoding_keeps_no_key_value_cache():
    model = aft_model("aft_simple")
    model.init_cache(B, 16)
    mixer = self_and_cross(model)[0]
    cached = {
        "/".join(map(str, path)): variable.shape
        for path, variable in nnx.to_flat_state(nnx.state(mixer, nnx.Cache))
    }
    assert cached == {name: (B, 32) for name in ("running_max", "numerator", "denominator")}


def test_save_hf_refuses_an_aft_model(tmp_path):
    cfg = tiny("gpt2-tiny", mixer="aft_simple")
    with pytest.raises(ValueError, match="mixer=aft_simple.*no Hugging Face counterpart"):
        save_hf(make(cfg), cfg, tmp_path)
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(mixer="aft"), "mixer"),
        (dict(mixer="aft_local"), "aft_window is the window of mixer aft_local"),
        (dict(mixer="aft_full", aft_window=4), "aft_window is the window of mixer aft_local"),
        (dict(mixer="aft_local", aft_window=0), "aft_window"),
        (dict(mixer="aft_full", positions="rope"), "positions='rope'"),
        (dict(mixer="aft_simple", positions="alibi"), "positions='alibi'"),
        (dict(mixer="aft_simple", local_window=(8, 0)), "not of mixer aft_simple"),
    ],
)
def test_config_refuses_bad_mixers(overrides, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_preset("gpt2-tiny", **overrides)


def test_full_and_local_refuse_inputs_beyond_max_length():
    model = aft_model("aft_full", max_length=8)
    with pytest.raises(ValueError, match="exceeds max_length=8"):
        model(tokens((1, 9)))


@pytest.mark.parametrize("name", list(AFT))
def test_each_mixer_learns_a_repeated_sequence(name):
    # Rows of a fixed random sequence: the next token is learnable from the previous ones.
    model = make(tiny("gpt2-tiny", **AFT[name]), train=True)
    optimizer = adam(model, 3e-3)
    batch = jnp.tile(tokens((1, 17), seed=6), (4, 1))
    losses = [float(lm_train_step(model, optimizer, batch)) for _ in range(60)]
    assert losses[-1] < 0.3 * losses[0], losses[::10]
