"""Hugging Face interop: our models match ``transformers``' GPT-2 and Llama logit for logit.

Randomly initialised tiny HF models are saved with ``save_pretrained`` (also sharded), loaded with
``load_hf`` and compared on random tokens to 1e-4 in float32; ``save_hf`` files are loaded back by
``from_pretrained``. ``torch`` and ``transformers`` come with the ``dev`` extra (CI installs it);
without them those tests skip, saying so. The error tests need neither.
"""

import json
import os
import re

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hf_checkpoints import randomize
from safetensors.numpy import load_file, save_file

from flaxformer_lite import ops
from flaxformer_lite.interop import SUPPORTED, load_hf, save_hf
from flaxformer_lite.models import ModelConfig, build_model

pytestmark = pytest.mark.fast_compile  # XLA's backend optimizations off: conftest.py

TOL = 1e-4  # float32, absolute
VOCAB = 128


@pytest.fixture(scope="module")
def ids():
    """Random token ids ``[2, 13]``, int64 numpy (as a tokenizer gives them)."""
    return np.random.default_rng(0).integers(0, VOCAB, (2, 13))


def hf_logits(hf, model, ids):
    with hf.torch.no_grad():
        return model(hf.torch.as_tensor(ids)).logits.numpy()


def hf_load(hf, path):
    """``from_pretrained`` of ``path``, checking that every tensor was used and none missing."""
    auto = hf.transformers.AutoModelForCausalLM
    model, info = auto.from_pretrained(path, output_loading_info=True)
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    return model.float().eval()


def max_diff(a, b):
    return float(np.max(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32))))


def check_load(hf, hf_model, path, ids):
    """``load_hf(path)`` gives ``hf_model``'s logits; returns our model and config."""
    model, cfg = load_hf(path)
    expected = hf_logits(hf, hf_model, ids)
    logits = model(ids)
    assert logits.shape == (*ids.shape, cfg.vocab_size)
    assert max_diff(logits, expected) < TOL
    assert max_diff(model(jnp.asarray(ids, jnp.int32)), logits) == 0.0  # jax ints too
    return model, cfg


def check_save(hf, model, cfg, path, ids):
    """``save_hf`` files load in ``transformers`` and give our logits."""
    save_hf(model, cfg, path)
    assert sorted(os.listdir(path)) == ["config.json", "model.safetensors"]
    assert max_diff(hf_logits(hf, hf_load(hf, path), ids), model(ids)) < TOL


# --------------------------------------------------------------------------- GPT-2
GPT2_VARIANTS = {
    "tied": dict(),
    "untied-relu-ninner": dict(tie_word_embeddings=False, activation_function="relu", n_inner=96),
}


@pytest.fixture(scope="module", params=sorted(GPT2_VARIANTS))
def gpt2(request, hf, tmp_path_factory):
    """A saved random tiny GPT-2: ``(hf_model, path)``."""
    config = hf.transformers.GPT2Config(
        n_layer=2,
        n_embd=64,
        n_head=4,
        vocab_size=VOCAB,
        n_positions=64,
        bos_token_id=0,
        eos_token_id=0,
        **GPT2_VARIANTS[request.param],
    )
    model = randomize(hf.torch, hf.transformers.GPT2LMHeadModel(config))
    path = tmp_path_factory.mktemp(f"gpt2-{request.param}")
    model.save_pretrained(path)
    return model, path


def test_gpt2_load_matches_hf(hf, gpt2, ids, tmp_path):
    hf_model, path = gpt2
    _, cfg = check_load(hf, hf_model, path, ids)
    hf_model.save_pretrained(tmp_path, max_shard_size="20KB")  # sharded, with an index
    assert os.path.isfile(tmp_path / "model.safetensors.index.json")
    assert check_load(hf, hf_model, tmp_path, ids)[1] == cfg
    assert (cfg.positions, cfg.norm, cfg.fused_qkv, cfg.max_length) == (
        "learned",
        "layernorm",
        True,
        64,
    )
    assert cfg.tie_embeddings == hf_model.config.tie_word_embeddings


def test_gpt2_save_round_trip(hf, gpt2, ids, tmp_path):
    model, cfg = load_hf(gpt2[1])
    check_save(hf, model, cfg, tmp_path, ids)
    assert load_hf(tmp_path)[1] == cfg


# --------------------------------------------------------------------------- Llama
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
LLAMA_VARIANTS = {
    # GQA (4 query heads share 2 key/value heads), llama3 rope scaling, separate head.
    "gqa-llama3-untied": dict(
        num_key_value_heads=2, rope_scaling=LLAMA3, rope_theta=5e5, tie_word_embeddings=False
    ),
    # MQA, plain RoPE, a tied head, biases everywhere and head_dim != hidden_size / heads.
    "mqa-biases-tied": dict(
        num_key_value_heads=1,
        head_dim=8,
        tie_word_embeddings=True,
        attention_bias=True,
        mlp_bias=True,
    ),
    "linear-rope": dict(
        num_key_value_heads=4,
        rope_scaling={"rope_type": "linear", "factor": 2.0},
        tie_word_embeddings=False,
    ),
}


@pytest.fixture(scope="module", params=sorted(LLAMA_VARIANTS))
def llama(request, hf, tmp_path_factory):
    """A saved random tiny Llama: ``(hf_model, path)``."""
    config = hf.transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        **LLAMA_VARIANTS[request.param],
    )
    model = randomize(hf.torch, hf.transformers.LlamaForCausalLM(config))
    path = tmp_path_factory.mktemp(f"llama-{request.param}")
    model.save_pretrained(path)
    return model, path


def test_llama_load_matches_hf(hf, llama, ids, tmp_path):
    hf_model, path = llama
    _, cfg = check_load(hf, hf_model, path, ids)
    hf_model.save_pretrained(tmp_path, max_shard_size="30KB")  # sharded, with an index
    assert len([f for f in os.listdir(tmp_path) if f.endswith(".safetensors")]) > 1
    assert check_load(hf, hf_model, tmp_path, ids)[1] == cfg
    hf_config = hf_model.config
    assert (cfg.norm, cfg.positions, cfg.activation) == ("rmsnorm", "rope", "swiglu")
    assert cfg.num_kv_heads == hf_config.num_key_value_heads
    assert cfg.tie_embeddings == hf_config.tie_word_embeddings
    assert cfg.head_dim == hf_config.head_dim
    if "llama3" in path.name:  # the scaling is read, not dropped
        assert cfg.rope_scaling == ops.RopeScaling.from_dict(LLAMA3) and cfg.rope_base == 5e5


def to_v4_config(config: dict) -> dict:
    """A transformers 5.x Llama config.json rewritten in the 4.x style: ``rope_theta`` and
    ``rope_scaling`` (null for plain RoPE; the older ``type`` key) for ``rope_parameters``."""
    config = dict(config)
    rope = dict(config.pop("rope_parameters", None) or {"rope_type": "default"})
    config["rope_theta"] = rope.pop("rope_theta", 10000.0)
    kind = rope.pop("rope_type")
    config["rope_scaling"] = None if kind == "default" else {"type": kind, **rope}
    return config


def test_llama_reads_both_config_styles(hf, llama, ids, tmp_path):
    hf_model, path = llama
    v5 = json.loads((path / "config.json").read_text())
    assert "rope_parameters" in v5  # what the installed (5.x) transformers writes
    (tmp_path / "config.json").write_text(json.dumps(to_v4_config(v5)))
    os.symlink(path / "model.safetensors", tmp_path / "model.safetensors")
    model, cfg = load_hf(tmp_path)
    assert cfg == load_hf(path)[1]
    assert max_diff(model(ids), hf_logits(hf, hf_model, ids)) < TOL


def test_llama_save_round_trip(hf, llama, ids, tmp_path):
    model, cfg = load_hf(llama[1])
    check_save(hf, model, cfg, tmp_path, ids)
    assert load_hf(tmp_path)[1] == cfg


# --------------------------------------------------------------------------- our own models
@pytest.mark.parametrize(
    "preset, overrides",
    [
        ("gpt2-tiny", {}),
        # A scanned stack (layers stacked on one axis) with llama3 scaling.
        ("llama-tiny", dict(scan_layers=True, rope_scaling=ops.RopeScaling.from_dict(LLAMA3))),
    ],
)
def test_save_hf_of_our_model(hf, preset, overrides, ids, tmp_path):
    cfg = ModelConfig.from_preset(preset, **overrides)
    model = build_model(cfg, rngs=nnx.Rngs(1))
    model.eval()
    check_save(hf, model, cfg, tmp_path, ids)


# --------------------------------------------------------------------------- errors
@pytest.fixture
def tiny_gpt2_dir(tmp_path):
    """A checkpoint written by ``save_hf`` (no torch needed)."""
    cfg = ModelConfig.from_preset("gpt2-tiny")
    save_hf(build_model(cfg, rngs=nnx.Rngs(0)), cfg, tmp_path)
    return tmp_path


def edit_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


def test_unknown_architecture_lists_supported(tiny_gpt2_dir):
    edit_config(tiny_gpt2_dir, architectures=["BertForTokenClassification"], model_type="bert")
    with pytest.raises(ValueError, match="BertForTokenClassification") as error:
        load_hf(tiny_gpt2_dir)
    assert all(name in str(error.value) for name in SUPPORTED)


def test_missing_files_are_named(tiny_gpt2_dir, tmp_path_factory):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_hf(tiny_gpt2_dir / "nowhere")
    empty = tmp_path_factory.mktemp("empty")
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_hf(empty)
    (empty / "config.json").write_text((tiny_gpt2_dir / "config.json").read_text())
    (empty / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="model.safetensors.*pytorch_model.bin"):
        load_hf(empty)


def test_missing_shard_is_named(tiny_gpt2_dir):
    names = load_file(tiny_gpt2_dir / "model.safetensors")
    index = {"weight_map": {name: "model-00001-of-00002.safetensors" for name in names}}
    (tiny_gpt2_dir / "model.safetensors").unlink()
    (tiny_gpt2_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(FileNotFoundError, match="model-00001-of-00002"):
        load_hf(tiny_gpt2_dir)


def test_missing_and_extra_tensors_are_named(tiny_gpt2_dir):
    file = tiny_gpt2_dir / "model.safetensors"
    tensors = load_file(file)
    save_file({k: v for k, v in tensors.items() if k != "transformer.h.1.mlp.c_fc.bias"}, file)
    with pytest.raises(ValueError, match=r"lacks.*h\.1\.mlp\.c_fc\.bias"):
        load_hf(tiny_gpt2_dir)
    save_file({**tensors, "transformer.h.0.extra.weight": np.zeros(3, np.float32)}, file)
    with pytest.raises(ValueError, match=r"does not use.*h\.0\.extra\.weight"):
        load_hf(tiny_gpt2_dir)
    edit_config(tiny_gpt2_dir, n_embd=32)
    save_file(tensors, file)
    with pytest.raises(ValueError, match="shape"):
        load_hf(tiny_gpt2_dir)


def test_gpt2_bare_names_and_buffers(tiny_gpt2_dir, ids):
    """Original OpenAI conversions name tensors without ``transformer.`` and may carry the causal
    mask buffers ``h.{i}.attn.bias``: both load to the same model."""
    expected = load_hf(tiny_gpt2_dir)[0](ids)
    file = tiny_gpt2_dir / "model.safetensors"
    tensors = {k.removeprefix("transformer."): v for k, v in load_file(file).items()}
    tensors["h.0.attn.bias"] = np.tril(np.ones((1, 1, 8, 8), np.float32))
    save_file(tensors, file)
    assert max_diff(load_hf(tiny_gpt2_dir)[0](ids), expected) == 0.0


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(activation_function="gelu_10"), "activation_function='gelu_10'"),
        (dict(scale_attn_by_inverse_layer_idx=True), "scale_attn_by_inverse_layer_idx"),
    ],
)
def test_unsupported_gpt2_settings_are_named(tiny_gpt2_dir, changes, message):
    edit_config(tiny_gpt2_dir, **changes)
    with pytest.raises(ValueError, match=message):
        load_hf(tiny_gpt2_dir)


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(hidden_act="gelu"), "hidden_act='gelu'"),
        (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope type 'yarn'"),
        (
            dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}),
            "rope type 'dynamic'",
        ),
        (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "beta": 1.0}), "beta"),
    ],
)
def test_unsupported_llama_settings_are_named(tmp_path, changes, message):
    cfg = ModelConfig.from_preset("llama-tiny")
    save_hf(build_model(cfg, rngs=nnx.Rngs(0)), cfg, tmp_path)
    edit_config(tmp_path, **changes)
    with pytest.raises(ValueError, match=message):
        load_hf(tmp_path)


def test_save_hf_rejects_other_architectures(tmp_path):
    cfg = ModelConfig.from_preset("llama-tiny", rope_layout="interleaved")
    with pytest.raises(ValueError, match="rope_layout='interleaved'"):
        save_hf(build_model(cfg, rngs=nnx.Rngs(0)), cfg, tmp_path)
    cfg = ModelConfig.from_preset("transformer-tiny")
    with pytest.raises(ValueError, match="save_hf writes only"):
        save_hf(build_model(cfg, rngs=nnx.Rngs(0)), cfg, tmp_path)


def test_load_hf_dtype(tiny_gpt2_dir):
    model, cfg = load_hf(tiny_gpt2_dir, dtype="bfloat16")
    assert cfg.dtype == cfg.param_dtype == "bfloat16"
    assert model.embed.tokens.embedding[...].dtype == jnp.bfloat16
    with pytest.raises(ValueError, match="dtype"):
        load_hf(tiny_gpt2_dir, dtype="int8")


# --------------------------------------------------------------------------- Marian
MARIAN_VARIANTS = {
    # OPUS-MT's shape: one table for source, target and output, swish, scaled embeddings.
    "shared-tied-swish": dict(activation_function="swish", scale_embedding=True),
    # Separate source and target tables, the head tied to the target's; unscaled, GELU.
    "separate-tied-gelu": dict(share_encoder_decoder_embeddings=False, activation_function="gelu"),
    # A separate output projection: transformers 5.x then unties the source and target tables too.
    "shared-untied-relu": dict(tie_word_embeddings=False, activation_function="relu"),
}
MARIAN_POSITIONS = r"model\.(encoder|decoder)\.embed_positions\.weight"


@pytest.fixture(scope="module")
def src_tgt():
    """``(src [2, 11], tgt [2, 7], padding_mask [2, 11])``: int64 ids, the second source padded
    (pad id 127) after 7 tokens; the mask is bool, False at padding."""
    rng = np.random.default_rng(1)
    src, tgt = rng.integers(0, VOCAB - 1, (2, 11)), rng.integers(0, VOCAB - 1, (2, 7))
    mask = np.ones(src.shape, bool)
    mask[1, 7:], src[1, 7:] = False, VOCAB - 1
    return src, tgt, mask


def randomize_marian(hf, model, seed=0):
    """``randomize`` (which leaves Marian's fixed position tables alone), and the
    ``final_logits_bias`` buffer moved too."""
    model = randomize(hf.torch, model, seed)
    generator = hf.torch.Generator().manual_seed(seed + 1)
    with hf.torch.no_grad():
        model.final_logits_bias.add_(
            hf.torch.randn(model.final_logits_bias.shape, generator=generator)
        )
    return model


def marian_logits(hf, model, src_tgt):
    src, tgt, mask = (hf.torch.as_tensor(x) for x in src_tgt)
    with hf.torch.no_grad():
        outputs = model(input_ids=src, attention_mask=mask.long(), decoder_input_ids=tgt)
    return outputs.logits.numpy()


@pytest.fixture(scope="module", params=sorted(MARIAN_VARIANTS))
def marian(request, hf, tmp_path_factory):
    """A saved random tiny Marian: ``(hf_model, path)``."""
    config = hf.transformers.MarianConfig(
        vocab_size=VOCAB,
        d_model=64,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=128,
        decoder_ffn_dim=128,
        max_position_embeddings=64,
        pad_token_id=VOCAB - 1,
        decoder_start_token_id=VOCAB - 1,
        eos_token_id=0,
        **MARIAN_VARIANTS[request.param],
    )
    model = randomize_marian(hf, hf.transformers.MarianMTModel(config))
    path = tmp_path_factory.mktemp(f"marian-{request.param}")
    model.save_pretrained(path)
    return model, path


def check_marian_load(hf, hf_model, path, src_tgt):
    """``load_hf(path)`` gives ``hf_model``'s logits with source padding; returns our model and
    config."""
    model, cfg = load_hf(path)
    src, tgt, mask = src_tgt
    expected = marian_logits(hf, hf_model, src_tgt)
    logits = model(src, tgt, padding_mask=mask)
    assert logits.shape == (*tgt.shape, cfg.vocab_size)
    assert max_diff(logits, expected) < TOL
    as_jax = model(jnp.asarray(src, jnp.int32), jnp.asarray(tgt, jnp.int32), padding_mask=mask)
    assert max_diff(as_jax, logits) == 0.0  # jax ints too
    return model, cfg


def test_marian_load_matches_hf(hf, marian, src_tgt, tmp_path):
    hf_model, path = marian
    _, cfg = check_marian_load(hf, hf_model, path, src_tgt)
    hf_config = hf_model.config
    assert (cfg.kind, cfg.norm_position, cfg.positions, cfg.sinusoidal_layout) == (
        "encoder_decoder",
        "post",
        "sinusoidal",
        "concat",
    )
    assert cfg.output_bias and not cfg.embed_norm
    assert cfg.scale_embeddings == hf_config.scale_embedding
    assert cfg.tie_embeddings == hf_config.tie_word_embeddings
    assert cfg.share_src_tgt_embeddings == (
        hf_config.share_encoder_decoder_embeddings and hf_config.tie_word_embeddings
    )
    sharded = tmp_path / "sharded"
    hf_model.save_pretrained(sharded, max_shard_size="30KB")  # sharded, with an index
    assert len([f for f in os.listdir(sharded) if f.endswith(".safetensors")]) > 1
    assert check_marian_load(hf, hf_model, sharded, src_tgt)[1] == cfg


def test_marian_loads_stored_position_tables_and_aliases(hf, marian, src_tgt, tmp_path):
    """Recent ``transformers`` saves neither the fixed position tables nor the aliases of a
    shared table; older conversions store all of them. Both load to the same model."""
    hf_model, path = marian
    tensors = load_file(path / "model.safetensors")
    assert not any(re.fullmatch(MARIAN_POSITIONS, name) for name in tensors)
    state = {k: v.numpy() for k, v in hf_model.state_dict().items()}
    assert any(re.fullmatch(MARIAN_POSITIONS, name) for name in state)
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    check_marian_load(hf, hf_model, tmp_path, src_tgt)


def test_marian_save_round_trip(hf, marian, src_tgt, tmp_path):
    model, cfg = load_hf(marian[1])
    check_marian_save(hf, model, cfg, tmp_path, src_tgt)
    assert load_hf(tmp_path)[1] == cfg


def check_marian_save(hf, model, cfg, path, src_tgt):
    """``save_hf`` files load in ``transformers`` (no missing or unused tensors) and give our
    logits."""
    save_hf(model, cfg, path)
    assert sorted(os.listdir(path)) == ["config.json", "model.safetensors"]
    auto = hf.transformers.AutoModelForSeq2SeqLM
    hf_model, info = auto.from_pretrained(path, output_loading_info=True)
    assert type(hf_model).__name__ == "MarianMTModel"
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    src, tgt, mask = src_tgt
    expected = marian_logits(hf, hf_model.float().eval(), src_tgt)
    assert max_diff(model(src, tgt, padding_mask=mask), expected) < TOL


@pytest.mark.parametrize("tied", [True, False])
def test_save_hf_of_our_marian(hf, src_tgt, tmp_path, tied):
    """Our paper Transformer with Marian's settings (a scanned stack, so both towers' layers are
    split back out) is a Marian; also with one table for both sides and a separate head."""
    marian_like = dict(
        sinusoidal_layout="concat",
        norm_eps=1e-5,
        output_bias=True,
        activation="silu",
        vocab_size=VOCAB,
        scan_layers=True,
        tie_embeddings=tied,
    )
    cfg = ModelConfig.from_preset("transformer-tiny", **marian_like)
    model = build_model(cfg, rngs=nnx.Rngs(1))
    model.eval()
    bias = model.head.bias if tied else model.head.projection.bias
    bias[...] = jnp.linspace(-1.0, 1.0, VOCAB)  # zero at init: make it count
    check_marian_save(hf, model, cfg, tmp_path, src_tgt)
    src, tgt, mask = src_tgt
    loaded, _ = load_hf(tmp_path)
    assert max_diff(loaded(src, tgt, padding_mask=mask), model(src, tgt, padding_mask=mask)) < TOL
    with pytest.raises(ValueError, match="sinusoidal_layout='interleaved'"):
        save_hf(model, cfg.replace(sinusoidal_layout="interleaved"), tmp_path)


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(activation_function="gelu_10"), "activation_function='gelu_10'"),
        (dict(decoder_attention_heads=2), "encoder_attention_heads=4 != decoder_attention_heads"),
        (dict(decoder_vocab_size=64), "decoder_vocab_size=64"),
    ],
)
def test_unsupported_marian_settings_are_named(tmp_path, changes, message):
    cfg = ModelConfig.from_preset(
        "transformer-tiny", sinusoidal_layout="concat", norm_eps=1e-5, output_bias=True
    )
    save_hf(build_model(cfg, rngs=nnx.Rngs(0)), cfg, tmp_path)
    edit_config(tmp_path, **changes)
    with pytest.raises(ValueError, match=message):
        load_hf(tmp_path)


def test_save_hf_replaces_files_whole(hf, gpt2, ids, tmp_path, monkeypatch):
    """save_hf writes under temporary names and renames: nothing else is left in the directory,
    and a save that fails while writing the weights leaves the previous checkpoint loadable."""
    from flaxformer_lite.interop import common

    model, cfg = load_hf(gpt2[1])
    save_hf(model, cfg, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}

    def failing_save(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"half")
        raise OSError("disk full")

    monkeypatch.setattr(common, "save_file", failing_save)
    with pytest.raises(OSError, match="disk full"):
        save_hf(model, cfg, tmp_path)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.suffix != ".tmp"} == before
    assert max_diff(load_hf(tmp_path)[0](ids), model(ids)) == 0.0
