"""ModelConfig validation and presets, parameter counts and FLOP accounting."""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from flaxformer_lite import ops
from flaxformer_lite.models import (
    PRESETS,
    DecoderLM,
    Encoder,
    EncoderDecoder,
    ModelConfig,
    build_model,
    parameter_counts,
    training_flops_per_token,
)

pytestmark = pytest.mark.fast_compile  # XLA's backend optimizations off: conftest.py


def test_transformer_base_has_the_papers_size():
    """Table 3's base model: the paper reports 65M; with a 37,000-token shared vocabulary and
    the parameters spelled out it is 63.1M."""
    counts = parameter_counts(ModelConfig.from_preset("transformer-base"))
    d, f, v, layers = 512, 2048, 37000, 6
    attention = 4 * (d * d + d)
    mlp = d * f + f + f * d + d
    norm = 2 * d
    expected = (
        v * d + layers * (attention + mlp + 2 * norm) + layers * (2 * attention + mlp + 3 * norm)
    )
    assert counts["total"] == expected
    assert counts["total"] == pytest.approx(63.1e6, rel=2e-3)
    assert counts["non_embedding"] == expected - v * d


def test_gpt2_small_matches_hugging_face():
    # GPT2LMHeadModel("gpt2").num_parameters() == 124,439,808.
    assert parameter_counts(ModelConfig.from_preset("gpt2-small"))["total"] == 124_439_808


def test_bert_base_matches_hugging_face_masked_lm():
    # BertForMaskedLM("bert-base-uncased").num_parameters() == 109,514,298 (no pooler).
    assert parameter_counts(ModelConfig.from_preset("bert-base"))["total"] == 109_514_298


def test_llama_style_matches_llama_3_2_1b():
    # LlamaForCausalLM (Llama-3.2-1B, tied embeddings).num_parameters() == 1,235,814,400.
    assert parameter_counts(ModelConfig.from_preset("llama-style"))["total"] == 1_235_814_400


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_builds_the_right_model_abstractly(name):
    cfg = ModelConfig.from_preset(name)
    model = nnx.eval_shape(lambda: build_model(cfg, rngs=nnx.Rngs(0)))
    expected = {"encoder_decoder": EncoderDecoder, "decoder": DecoderLM, "encoder": Encoder}
    assert isinstance(model, expected[cfg.kind])
    assert parameter_counts(model)["total"] > 0


def test_presets_carry_the_published_choices():
    base = ModelConfig.from_preset("transformer-base")
    assert (base.norm_position, base.positions, base.activation) == ("post", "sinusoidal", "relu")
    assert base.tie_embeddings and base.scale_embeddings and base.share_src_tgt_embeddings
    big = ModelConfig.from_preset("transformer-big")
    assert (big.d_model, big.num_heads, big.d_ff, big.residual_dropout) == (1024, 16, 4096, 0.3)
    llama = ModelConfig.from_preset("llama-style")
    assert (llama.norm, llama.positions, llama.activation) == ("rmsnorm", "rope", "swiglu")
    assert llama.num_kv_heads < llama.num_heads
    assert not (llama.qkv_bias or llama.mlp_bias or llama.attention_out_bias)
    assert llama.rope_scaling == ops.RopeScaling(
        type="llama3",
        factor=32.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=8192,
    )
    for name in ("transformer", "gpt2", "bert", "llama"):
        assert f"{name}-tiny" in PRESETS


def test_overrides_and_dict_round_trip():
    cfg = ModelConfig.from_preset("llama-tiny", num_heads=8, scan_layers=True)
    assert cfg.num_heads == 8 and cfg.scan_layers
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    scaled = ModelConfig.from_preset("llama-style")
    assert ModelConfig.from_dict(scaled.to_dict()) == scaled  # nested RopeScaling
    assert cfg.replace(d_model=128).d_model == 128
    hash(cfg)  # frozen and hashable: usable as a static jit argument


def test_derived_defaults_are_resolved_once_and_follow_replace():
    gpt2 = ModelConfig.from_preset("gpt2-tiny")  # num_kv_heads and head_dim left unset
    assert (gpt2.num_kv_heads, gpt2.head_dim) == (4, 16)
    assert gpt2.to_dict()["num_kv_heads"] == 4 and gpt2.to_dict()["head_dim"] == 16
    assert ModelConfig.from_dict({**gpt2.to_dict(), "num_kv_heads": None}) == gpt2
    underived = gpt2.to_dict(derived=False)
    assert (underived["num_kv_heads"], underived["head_dim"]) == (None, None)
    # A derived value follows what it derives from; a chosen one stays, even one equal to it.
    assert (gpt2.replace(num_heads=8).num_kv_heads, gpt2.replace(num_heads=8).head_dim) == (8, 8)
    chosen = ModelConfig.from_preset("llama-tiny", num_kv_heads=4, head_dim=16)
    assert chosen.to_dict(derived=False)["num_kv_heads"] == 4
    assert (chosen.replace(num_heads=8).num_kv_heads, chosen.replace(d_model=128).head_dim) == (
        4,
        16,
    )
    assert gpt2.replace(d_model=128).head_dim == 32
    assert gpt2.replace(num_heads=2, num_kv_heads=1, fused_qkv=False).num_kv_heads == 1
    llama = ModelConfig.from_preset("llama-tiny")  # num_kv_heads=2 of 4 heads
    assert llama.replace(num_heads=8).num_kv_heads == 2
    assert ModelConfig.from_preset("gpt2-tiny", head_dim=8).replace(d_model=128).head_dim == 8


def test_configs_saved_with_null_derived_values_resolve_alike():
    """config.yaml and checkpoints of older runs hold ``num_kv_heads: null`` and
    ``head_dim: null``: they load as the resolved values, and a run resumed from them sees no
    change of config."""
    from flaxformer_lite.train.config import TrainConfig, config_diff, config_from_dict

    current = TrainConfig()
    older = current.to_dict()
    older["model"].update(num_kv_heads=None, head_dim=None)
    saved = config_from_dict(older)
    assert saved.model.num_kv_heads == 4 and saved.model.head_dim == 16
    assert saved == current and config_diff(saved, current) == {}


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(num_heads=6), "num_heads"),  # 64 % 6
        (dict(num_kv_heads=3), "multiple of num_kv_heads"),
        (dict(norm="batchnorm"), "norm must be one of"),
        (dict(positions="absolute"), "positions must be one of"),
        (dict(activation="tanh"), "activation must be one of"),
        (dict(norm_position="sandwich"), "norm_position"),
        (dict(remat="some"), "remat must be one of"),
        (dict(dtype="float8"), "dtype must be one of"),
        (dict(residual_dropout=1.0), "residual_dropout"),
        (dict(vocab_size=0), "vocab_size must be a positive int"),
        (dict(num_decoder_layers=0), "num_encoder_layers > 0 or num_decoder_layers > 0"),
        (dict(input_dim=3), "tie_embeddings"),
        (dict(positions="rope", head_dim=15), "even head_dim"),
        (dict(num_classes=2), "encoder-only"),
        (dict(init="uniform"), "init must be one of"),
        (dict(rope_base=0.0), "rope_base must be a number > 0"),
        (dict(norm_eps="a"), "norm_eps must be a number > 0"),
        (dict(positions="relative", relative_buckets=2), "relative_buckets >= 4"),
        (dict(positions="relative", relative_max_distance=8, relative_buckets=32), "max_distance"),
        (dict(type_vocab_size=2), "encoder-only"),
        (dict(output_dim=2, tie_embeddings=False, output_bias=True), "output_bias"),
    ],
)
def test_invalid_configs_name_the_problem(overrides, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_preset("gpt2-tiny", **overrides)


def test_unknown_names_suggest_the_closest():
    with pytest.raises(ValueError, match="did you mean 'num_heads'"):
        ModelConfig.from_preset("gpt2-tiny", num_head=4)
    with pytest.raises(ValueError, match="did you mean 'gpt2-small'.*presets: "):
        ModelConfig.from_preset("gpt2-smal")


def test_model_classes_check_their_layer_counts():
    with pytest.raises(ValueError, match="num_encoder_layers > 0 and num_decoder_layers > 0"):
        EncoderDecoder(ModelConfig.from_preset("gpt2-tiny"), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="num_encoder_layers > 0"):
        Encoder(ModelConfig.from_preset("gpt2-tiny"), rngs=nnx.Rngs(0))


def _compiled_flops(cfg, seq_len, batch=2):
    model = build_model(cfg, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    tokens = jnp.zeros((batch, seq_len), jnp.int32)

    def loss(params, tokens):
        return nnx.merge(graphdef, params)(tokens).astype(jnp.float32).mean()

    forward = jax.jit(loss).lower(state, tokens).compile().cost_analysis()["flops"]
    train = jax.jit(jax.grad(loss, allow_int=True)).lower(state, tokens).compile()
    return forward / (batch * seq_len), train.cost_analysis()["flops"] / (batch * seq_len)


def test_flops_per_token_agree_with_xla_for_bidirectional_attention():
    """XLA counts every multiply-add of the compiled program; ours counts the matmuls only, so
    the two agree up to the elementwise work (softmax, norms, activations)."""
    cfg = ModelConfig.from_preset(
        "bert-tiny",
        d_model=256,
        d_ff=1024,
        vocab_size=512,
        attention_implementation="xla",
        embedding_dropout=0.0,
        attention_dropout=0.0,
        residual_dropout=0.0,
    )
    forward, train = _compiled_flops(cfg, seq_len=128)
    ours = training_flops_per_token(cfg, 128)
    assert 1.0 <= forward / (ours / 3) < 1.12
    assert 0.95 <= train / ours < 1.15


def test_residual_projections_are_scaled_down_only_where_published():
    """GPT-2 scales the init of the projections writing into the residual stream by
    1/sqrt(2 * layers); BERT and LLaMA use plain N(0, 0.02)."""

    def stds(preset):
        cfg = ModelConfig.from_preset(preset, d_model=128, d_ff=256, num_heads=4)
        model = build_model(cfg, rngs=nnx.Rngs(0))
        tower = model.encoder if cfg.kind == "encoder" else model.decoder
        layer = tower.layers.layers[0]
        kernels = (layer.self_attention.out.kernel, layer.mlp.wi.kernel, layer.mlp.wo.kernel)
        return [float(jnp.std(kernel[...])) for kernel in kernels]

    out, wi, wo = stds("gpt2-tiny")  # 2 layers: 0.02 / sqrt(4)
    assert out == pytest.approx(0.01, rel=0.03) and wo == pytest.approx(0.01, rel=0.03)
    assert wi == pytest.approx(0.02, rel=0.03)
    for preset in ("bert-tiny", "llama-tiny"):
        assert stds(preset) == pytest.approx([0.02] * 3, rel=0.03)


def test_continuous_inputs_count_their_projection():
    tokens = ModelConfig.from_preset("gpt2-tiny", tie_embeddings=False)
    features = tokens.replace(input_dim=7)
    extra = training_flops_per_token(features, 64) - training_flops_per_token(tokens, 64)
    assert extra == 6 * 7 * tokens.d_model


def test_causal_attention_counts_half_and_gqa_counts_fewer_projections():
    gpt = ModelConfig.from_preset("gpt2-tiny")
    d, layers, t = gpt.d_model, gpt.num_decoder_layers, 100
    n = layers * (4 * d * d + 2 * d * gpt.d_ff) + d * gpt.vocab_size
    assert training_flops_per_token(gpt, t) == 6 * n + 6 * layers * d * t
    mha = ModelConfig.from_preset("llama-tiny", num_kv_heads=4)
    gqa = ModelConfig.from_preset("llama-tiny", num_kv_heads=1)
    saved = 6 * mha.num_decoder_layers * 2 * mha.d_model * 3 * mha.head_dim
    assert training_flops_per_token(mha, t) - training_flops_per_token(gqa, t) == saved


def test_fused_qkv_with_grouped_query_attention():
    from flaxformer_lite.interop import gpt2

    assert ModelConfig.from_preset("gpt2-small", num_kv_heads=2).num_kv_heads == 2
    cfg = ModelConfig.from_preset("gpt2-tiny", num_kv_heads=1)
    model = build_model(cfg, rngs=nnx.Rngs(0))
    attention = model.decoder.layers.layers[0].self_attention
    assert attention.qkv.kernel.shape == (cfg.d_model, cfg.num_heads + 2, cfg.head_dim)
    logits = model(jnp.zeros((1, 5), jnp.int32))
    assert logits.shape == (1, 5, cfg.vocab_size) and bool(jnp.isfinite(logits).all())
    with pytest.raises(ValueError, match="num_kv_heads=1"):
        gpt2.config_to_hf(cfg)


def test_norm_bias_false_drops_every_layernorm_bias_and_nothing_else():
    """nanoGPT's ``bias=False``: with the projections' biases off too, no bias is left; the
    function is the biased model's with zero biases, which is how GPT-2 export writes it."""
    from flaxformer_lite.interop.gpt2 import mismatches

    settings = dict(vocab_size=32, d_model=16, num_heads=2, d_ff=32, max_length=8)
    settings |= dict(embedding_dropout=0.0, attention_dropout=0.0, residual_dropout=0.0)
    settings |= dict(qkv_bias=False, attention_out_bias=False, mlp_bias=False)
    biased = ModelConfig.from_preset("gpt2-tiny", **settings)
    plain = biased.replace(norm_bias=False)
    norms = 2 * plain.num_decoder_layers + 1
    counts = parameter_counts(biased)["total"] - parameter_counts(plain)["total"]
    assert counts == norms * plain.d_model
    model = build_model(plain, rngs=nnx.Rngs(0))
    paths = [".".join(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(model, nnx.Param))]
    assert not [p for p in paths if "bias" in p]
    reference = build_model(biased, rngs=nnx.Rngs(1))  # its biases are zeros
    nnx.update(reference, nnx.state(model, nnx.Param))  # every other parameter the same
    tokens = jnp.arange(16).reshape(2, 8) % 32
    assert jnp.array_equal(model(tokens), reference(tokens))
    assert mismatches(plain) == []  # exported as GPT-2 with zero biases
    with pytest.raises(ValueError, match="norm_bias=False applies to layernorm"):
        ModelConfig.from_preset("llama-tiny", norm_bias=False)
