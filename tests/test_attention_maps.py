"""attention_maps: the weights every layer really uses, their heatmaps, and the CLI."""

import math
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from subprocess_env import subprocess_env

from flaxformer_lite import ops
from flaxformer_lite.attention_maps import (
    attention_maps,
    plot_attention_maps,
    text_inputs,
    token_labels,
)
from flaxformer_lite.cli import main
from flaxformer_lite.data.tokenizers import ByteTokenizer
from flaxformer_lite.models import EncoderDecoder, ModelConfig, build_model
from flaxformer_lite.nn.attention import MultiHeadAttention
from flaxformer_lite.nn.stack import stack_layer_states
from flaxformer_lite.train.checkpoint import Checkpointer
from flaxformer_lite.train.checkpoint_format import to_savable
from flaxformer_lite.train.config import load_config
from flaxformer_lite.train.optim import make_optimizer
from flaxformer_lite.train.program import make_train_state

B, T, S = 2, 7, 9
pytestmark = pytest.mark.fast_compile  # XLA's backend optimizations off: conftest.py

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# Maps of one model from two programs (scan and loop, eager and jit), which may sum in other
# orders: weights in [0, 1] agree to float32 round-off of the logits behind them.
MAPS_ATOL = 1e-5


def make(preset, *, seed=0, **overrides):
    cfg = ModelConfig.from_preset(preset, vocab_size=64, **overrides)
    model = build_model(cfg, rngs=nnx.Rngs(seed))
    model.eval()
    return model


def tokens(shape, seed=0):
    return jax.random.randint(jax.random.key(seed), shape, 4, 64)


def lengths_mask(lengths, length):
    return jnp.arange(length)[None, :] < jnp.asarray(lengths)[:, None]


def all_maps(maps):
    return [w for ws in maps.values() for w in ws] if isinstance(maps, dict) else maps


def maps_of(preset, padding_mask=None, **overrides):
    model = make(preset, **overrides)
    if isinstance(model, EncoderDecoder):
        return attention_maps(
            model, tokens((B, S), seed=1), tokens((B, T)), padding_mask=padding_mask
        )
    return attention_maps(model, tokens((B, T)), padding_mask=padding_mask)


# ------------------------------------------------------------------ what the weights are


@pytest.mark.parametrize("preset", ["gpt2-tiny", "llama-tiny", "bert-tiny", "transformer-tiny"])
def test_shapes_and_rows_summing_to_one(preset):
    maps = maps_of(preset)
    if preset == "transformer-tiny":
        assert [len(maps[k]) for k in ("encoder", "decoder", "cross")] == [2, 2, 2]
        shapes = {k: {w.shape for w in ws} for k, ws in maps.items()}
        assert shapes == {
            "encoder": {(B, 4, S, S)},
            "decoder": {(B, 4, T, T)},
            "cross": {(B, 4, T, S)},
        }
    else:
        assert len(maps) == 2 and {w.shape for w in maps} == {(B, 4, T, T)}
    for w in all_maps(maps):
        assert w.dtype == jnp.float32 and float(w.min()) >= 0
        np.testing.assert_allclose(w.sum(-1), 1.0, atol=1e-5)


@pytest.mark.parametrize("preset", ["gpt2-tiny", "llama-tiny", "transformer-tiny"])
def test_causal_self_attention_has_no_weight_above_the_diagonal(preset):
    maps = maps_of(preset, positions="alibi") if preset == "gpt2-tiny" else maps_of(preset)
    causal = maps["decoder"] if isinstance(maps, dict) else maps
    for w in causal:
        assert np.all(np.triu(np.asarray(w), k=1) == 0)
        assert np.all(np.diagonal(np.asarray(w), axis1=-2, axis2=-1) > 0)
    if isinstance(maps, dict):  # bidirectional encoder and cross-attention see ahead
        for w in maps["encoder"] + maps["cross"]:
            assert np.triu(np.asarray(w), k=1).max() > 0


@pytest.mark.parametrize("preset", ["gpt2-tiny", "bert-tiny", "transformer-tiny"])
def test_padding_keys_get_zero_weight(preset):
    length = S if preset == "transformer-tiny" else T
    maps = maps_of(preset, padding_mask=lengths_mask([length, 4], length))
    padded = maps["encoder"] + maps["cross"] if isinstance(maps, dict) else maps
    for w in padded:
        w = np.asarray(w)
        assert np.all(w[1, :, :, 4:] == 0) and w[0, :, :, 4:].max() > 0
        np.testing.assert_allclose(w.sum(-1), 1.0, atol=1e-5)  # padded queries see real keys


def naive_weights(q, k, bias, mask, is_causal):
    """softmax(q kᵀ / sqrt(Dh) + bias) in float64 numpy, query head n on key head n // G."""
    q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
    k = np.repeat(k, q.shape[2] // k.shape[2], axis=2)
    logits = np.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    if bias is not None:
        logits = logits + np.asarray(bias, np.float64)
    allowed = np.ones(logits.shape, bool)
    if mask is not None:
        allowed = allowed & np.asarray(mask)
    if is_causal:
        tq, tk = logits.shape[-2:]
        allowed = allowed & np.tri(tq, tk, k=tk - tq, dtype=bool)
    logits = np.where(allowed, logits, -np.inf)
    weights = np.exp(logits - logits.max(-1, keepdims=True))
    return weights / weights.sum(-1, keepdims=True)


@pytest.mark.parametrize(
    "preset, overrides",
    [
        ("gpt2-tiny", {"positions": "relative"}),  # fused QKV, T5 relative-position bias
        ("gpt2-tiny", {"positions": "alibi", "num_kv_heads": 1, "fused_qkv": False}),  # MQA
        ("llama-tiny", {}),  # RoPE, grouped-query (4 query heads on 2 key/value heads)
        ("bert-tiny", {}),  # bidirectional, padding
        ("transformer-tiny", {"positions": "relative"}),  # self + cross, padded source
    ],
)
def test_weights_are_the_ones_the_model_attends_with(preset, overrides, monkeypatch):
    """Independently of attention_maps: a spy in place of ``ops.dot_product_attention``
    records what every layer passes to it (q after RoPE, k, v, bias, mask) and what it gets
    back. The maps equal a float64 numpy softmax of those q and k, and applied to those v
    they give the attention output the layer went on with."""
    calls = []
    attention = ops.dot_product_attention

    def spy(q, k, v, bias, mask, **kwargs):
        # These presets have no segments, no window and no cache offset: q, k, bias, the
        # explicit mask and causality are all that shapes the weights.
        assert mask.segment_ids is None and mask.local_window is None
        assert mask.query_offset is None
        out = attention(q, k, v, bias, mask, **kwargs)
        explicit, is_causal = mask.explicit, mask.is_causal
        calls.append(dict(q=q, k=k, v=v, bias=bias, mask=explicit, is_causal=is_causal, out=out))
        return out

    monkeypatch.setattr(ops, "dot_product_attention", spy)
    model = make(preset, **overrides)
    if isinstance(model, EncoderDecoder):
        maps = attention_maps(
            model, tokens((B, S), seed=1), tokens((B, T)), padding_mask=lengths_mask([S, 4], S)
        )
        # The order the layers run in: encoder layers, then per decoder layer self and cross.
        decoder = [w for pair in zip(maps["decoder"], maps["cross"], strict=True) for w in pair]
        ordered = maps["encoder"] + decoder
    else:
        ordered = attention_maps(model, tokens((B, T)), padding_mask=lengths_mask([T, 5], T))
    assert len(calls) == len(ordered) > 0
    for weights, call in zip(ordered, calls, strict=True):
        expected = naive_weights(
            call["q"], call["k"], call["bias"], call["mask"], call["is_causal"]
        )
        np.testing.assert_allclose(weights, expected, atol=2e-6)
        v = np.repeat(np.asarray(call["v"]), weights.shape[1] // call["v"].shape[2], axis=2)
        out = np.einsum("bhqk,bkhd->bqhd", np.asarray(weights), v)
        np.testing.assert_allclose(out, call["out"], atol=2e-5)


@pytest.mark.parametrize("preset", ["gpt2-tiny", "llama-tiny"])
def test_weights_reproduce_the_attention_sublayer(preset):
    """From the outside of the layer: the first layer's input recomputed from the embeddings,
    the weights times the layer's own value projection, merged over heads by its output
    projection, equal the output of the unmodified attention module."""
    model = make(preset, num_decoder_layers=1)
    x = tokens((B, T))
    [weights] = attention_maps(model, x)
    layer = model.decoder.layers.layers[0]
    attention = layer.self_attention
    h = layer.self_attention_norm(model.embed(x, jnp.arange(T)))  # pre-LN presets
    v = attention.qkv(h)[:, :, 2] if attention.fused_qkv else attention.value(h)
    v = jnp.repeat(v, weights.shape[1] // v.shape[2], axis=2)  # GQA: query head n on n // G
    merged = attention.out(jnp.einsum("bhqk,bkhd->bqhd", weights, v))
    np.testing.assert_allclose(merged, attention(h, is_causal=True), atol=1e-5)


def copy_loop_into_scan(loop, scanned):
    """Gives ``scanned`` (scan_layers=True) the parameters of ``loop`` (scan_layers=False)."""
    for name in ("encoder", "decoder"):
        if hasattr(loop, name):
            per_layer = [nnx.state(layer, nnx.Param) for layer in getattr(loop, name).layers.layers]
            nnx.update(getattr(scanned, name).layers.layers, stack_layer_states(per_layer))
            for part in ("relative_bias", "final_norm"):
                if getattr(getattr(loop, name), part) is not None:
                    nnx.update(
                        getattr(getattr(scanned, name), part),
                        nnx.state(getattr(getattr(loop, name), part)),
                    )
    for part in ("embed", "src_embed", "tgt_embed", "head"):
        if hasattr(loop, part):
            nnx.update(getattr(scanned, part), nnx.state(getattr(loop, part), nnx.Param))


def sow_flags(model):
    return {m.sow_weights for _, m in nnx.iter_modules(model) if isinstance(m, MultiHeadAttention)}


@pytest.mark.parametrize("preset", ["gpt2-tiny", "transformer-tiny"])
def test_scanned_and_looped_stacks_give_the_same_maps(preset):
    """A scanned stack sows inside nnx.scan: its maps come out one per layer, equal to those of
    the loop stack with the same parameters (remat on makes no difference)."""
    overrides = {"positions": "relative"}
    loop = make(preset, **overrides)
    scanned = make(preset, scan_layers=True, remat="full", seed=1, **overrides)
    copy_loop_into_scan(loop, scanned)
    src, tgt = tokens((B, S), seed=1), tokens((B, T))
    args = (src, tgt) if preset == "transformer-tiny" else (tgt,)
    expected, got = attention_maps(loop, *args), attention_maps(scanned, *args)
    assert (
        len(all_maps(got)) == len(all_maps(expected)) == (6 if preset == "transformer-tiny" else 2)
    )
    for a, b in zip(all_maps(expected), all_maps(got), strict=True):
        np.testing.assert_allclose(b, a, atol=MAPS_ATOL)
    # The caller's model is left as it was: still scanned, remat on, the flag off, nothing sown.
    stack = scanned.decoder.layers
    assert stack.scan and stack.remat == "full"
    assert sow_flags(scanned) == {False} and not nnx.state(scanned, nnx.Intermediate)


def test_the_flag_off_sows_nothing_and_on_sows_each_call():
    model = make("llama-tiny")
    x = tokens((B, T))
    _, sown = nnx.capture(lambda m: m(x), nnx.Intermediate)(model)
    assert not jax.tree.leaves(sown)  # the flag is off by default
    model.set_attributes(sow_weights=True)
    _, sown = nnx.capture(lambda m: m(x), nnx.Intermediate)(model)
    model.set_attributes(sow_weights=False)
    weights = [v.get_value() for _, v in nnx.to_flat_state(sown)]
    assert len(weights) == 2 and all(len(w) == 1 for w in weights)  # one call, one map a layer
    for w, expected in zip(weights, attention_maps(model, x), strict=True):
        np.testing.assert_array_equal(w[0], expected)


def test_the_model_is_not_modified_and_jit_works():
    model = make("llama-tiny")
    x = tokens((B, T))
    before = model(x)
    eager = attention_maps(model, x)
    assert sow_flags(model) == {False} and not nnx.state(model, nnx.Intermediate)
    np.testing.assert_array_equal(model(x), before)
    jitted = nnx.jit(attention_maps)(model, x)
    for a, b in zip(eager, jitted, strict=True):
        np.testing.assert_allclose(b, a, atol=MAPS_ATOL)
    # A model in training mode gets its dropout-free maps, and stays in training mode.
    dropping = make("llama-tiny", attention_dropout=0.5, residual_dropout=0.5)
    dropping.train()
    counts = jax.tree.map(np.asarray, nnx.state(dropping, nnx.RngCount))
    in_training = attention_maps(dropping, x)
    modes = {m.deterministic for _, m in nnx.iter_modules(dropping) if hasattr(m, "deterministic")}
    assert modes == {False}
    jax.tree.map(np.testing.assert_array_equal, nnx.state(dropping, nnx.RngCount), counts)
    dropping.eval()
    for a, b in zip(attention_maps(dropping, x), in_training, strict=True):
        np.testing.assert_array_equal(b, a)


def test_encoder_decoder_without_target_gives_the_encoder_only():
    maps = attention_maps(make("transformer-tiny"), tokens((B, S)))
    assert len(maps["encoder"]) == 2 and maps["decoder"] == [] and maps["cross"] == []
    with pytest.raises(ValueError, match="target is for an EncoderDecoder"):
        attention_maps(make("gpt2-tiny"), tokens((B, T)), tokens((B, T)))
    with pytest.raises(TypeError, match="DecoderLM, Encoder or EncoderDecoder"):
        attention_maps(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), tokens((B, T)))


# ------------------------------------------------------------------ text, labels, plots


def test_text_inputs_follow_the_training_layout():
    tok = ByteTokenizer()
    ids = tok.encode("ab")
    lm, none = text_inputs(make("gpt2-tiny"), tok, "ab")
    assert lm.tolist() == [[tok.sos_id, *ids]] and none is None
    assert text_inputs(make("bert-tiny"), tok, "ab")[0].tolist() == [[tok.sos_id, *ids, tok.eos_id]]
    src, tgt = text_inputs(make("transformer-tiny"), tok, "ab", "c")
    assert src.tolist() == [[*ids, tok.eos_id]] and tgt.tolist() == [[tok.sos_id, *tok.encode("c")]]
    with pytest.raises(ValueError, match="target text is for encoder-decoder"):
        text_inputs(make("gpt2-tiny"), tok, "ab", "c")


def test_token_labels_are_readable():
    tok = ByteTokenizer()
    ids = [tok.sos_id, *tok.encode("a ñ"), tok.eos_id, tok.pad_id]
    assert token_labels(tok, ids) == ["<sos>", "a", "␣", "<0xC3>", "<0xB1>", "<eos>", "<pad>"]


def test_plot_writes_one_png_per_layer_with_a_grid_of_heads(tmp_path):
    weights = np.asarray(maps_of("llama-tiny")[0][0])  # [H, T, T]
    labels = [f"t{i}" for i in range(T)]
    path = plot_attention_maps(
        weights, labels, labels, tmp_path / "sub" / "layer0.png", title="layer 0"
    )
    assert path.read_bytes()[:8] == PNG_MAGIC
    with pytest.raises(ValueError, match=r"\[heads, queries, keys\]"):
        plot_attention_maps(weights[None], labels, labels, tmp_path / "x.png")
    with pytest.raises(ValueError, match="6 row and 7 column labels"):
        plot_attention_maps(weights, labels[:6], labels, tmp_path / "x.png")


# ------------------------------------------------------------------ the CLI on saved runs


def untrained_run(run_dir, preset, *overrides):
    """A run directory as train.py lays it out (checkpoint, tokenizer), at initialization."""
    cfg = load_config(
        None, [f"run_dir={run_dir}", f"model.preset={preset}", "model.vocab_size=260", *overrides]
    )
    tx, _ = make_optimizer(cfg.optimizer, cfg.model, total_steps=cfg.train.steps)
    state = nnx.split(make_train_state(cfg, tx))[1]
    with Checkpointer(run_dir / "checkpoints", keep=1) as checkpointer:
        checkpointer.save(1, to_savable(state), data_state={}, config=cfg.to_dict(), force=True)
    ByteTokenizer().save(run_dir / "tokenizer")
    return run_dir


def written(capsys):
    lines = capsys.readouterr().out.splitlines()
    assert all(line.startswith("wrote ") for line in lines)
    return sorted(line.split("/")[-1] for line in lines)


def test_cli_plots_a_trained_encoder_decoder(trained_translation, tmp_path, capsys):
    """A tiny encoder-decoder (1 + 1 scanned layers) trained by train.py's loop (conftest.py)."""
    out = tmp_path / "maps"
    argv = [
        "attention",
        "--run_dir",
        str(trained_translation[0]),
        "--text",
        "forty-two",
        "--out",
        str(out),
    ]
    assert main([*argv, "--target", "42"]) == 0
    names = ["cross_layer0.png", "decoder_layer0.png", "encoder_layer0.png"]
    assert written(capsys) == names
    assert all((out / name).read_bytes()[:8] == PNG_MAGIC for name in names)
    earlier = [*argv[:-1], str(tmp_path / "earlier"), "--step", "10"]
    assert main(earlier) == 0  # an earlier checkpoint, without a target:
    assert written(capsys) == ["encoder_layer0.png"]  # the encoder only
    # The maps of the first call are the user's now: a folder with files is refused, whole.
    before = {name: (out / name).read_bytes() for name in names}
    assert main([*argv, "--target", "42"]) == 2
    assert "is not a new or empty folder" in capsys.readouterr().err
    assert {name: (out / name).read_bytes() for name in names} == before
    (tmp_path / "link").symlink_to(tmp_path / "earlier")
    assert main([*argv[:-1], str(tmp_path / "link")]) == 2
    assert "is not a new or empty folder" in capsys.readouterr().err


def test_cli_plots_a_decoder_into_the_run_by_default(tmp_path, capsys):
    run_dir = untrained_run(tmp_path / "run", "gpt2-tiny", "model.num_decoder_layers=1")
    text = "Hola Mundo, soy Alejandro!"
    assert main(["attention", "--run_dir", str(run_dir), "--text", text]) == 0
    assert written(capsys) == ["decoder_layer0.png"]
    assert (run_dir / "plots" / "attention" / "decoder_layer0.png").read_bytes()[:8] == PNG_MAGIC


def test_cli_on_an_aft_decoder_says_it_has_no_attention_weights(tmp_path):
    run_dir = untrained_run(
        tmp_path / "run", "gpt2-tiny", "model.num_decoder_layers=1", "model.mixer=aft_simple"
    )
    command = "import sys; from flaxformer_lite.cli import main; sys.exit(main())"
    argv = ["attention", "--run-dir", str(run_dir), "--text", "012+034="]
    child = subprocess.run(
        [sys.executable, "-c", command, *argv],
        env=subprocess_env(1),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert (child.returncode, child.stdout) == (2, ""), child.stderr[-3000:]
    assert child.stderr.splitlines()[-1:] == [
        f"error: {run_dir}: the self-attention mixer is aft_simple, which has no attention weights"
    ], child.stderr[-3000:]
    assert not (run_dir / "plots").exists()


@pytest.mark.slow
def test_cli_on_an_aft_encoder_decoder_plots_the_cross_attention_only(tmp_path, capsys):
    run_dir = untrained_run(
        tmp_path / "run",
        "transformer-tiny",
        "model.num_encoder_layers=1",
        "model.num_decoder_layers=1",
        "model.mixer=aft_full",
    )
    argv = ["attention", "--run_dir", str(run_dir), "--text", "forty-two"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "mixer is aft_full" in err and "--target plots" in err, err
    assert main([*argv, "--target", "42"]) == 0
    assert written(capsys) == ["cross_layer0.png"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--run_dir", "{tmp}/nope", "--text", "x"], "{tmp}/nope: no such run directory"),
        (["--run_dir", "{run}", "--text", "x", "--step", "5"], "no checkpoint for step 5"),
        (["--run_dir", "{run}", "--text", "x", "--target", "y"], "target text is for encoder-"),
    ],
)
def test_cli_errors_are_one_line_and_exit_2(tmp_path, capsys, args, message):
    run_dir = untrained_run(tmp_path / "run", "bert-tiny", "model.num_encoder_layers=1")
    args = [a.format(tmp=tmp_path, run=run_dir) for a in args]
    assert main(["attention", "--out", str(tmp_path / "maps"), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1
    assert message.format(tmp=tmp_path) in err
    assert not (tmp_path / "maps").exists()
