"""Hugging Face interop for GPT-2 and Llama: our ``DecoderLM`` matches ``transformers``' models
logit for logit.

Randomly initialised tiny HF models are saved with ``save_pretrained`` (also sharded), loaded with
``load_hf`` and compared on random tokens to 1e-4 in float32; ``save_hf`` files are loaded back by
``from_pretrained``. ``torch`` and ``transformers`` come with the ``dev`` extra (CI installs it);
without them these tests skip, saying so.
"""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hf_checkpoints import TOL, VOCAB, max_diff, randomize

from flaxformer_lite import ops
from flaxformer_lite.interop import load_hf, save_hf
from flaxformer_lite.models import ModelConfig, build_model

pytestmark = pytest.mark.fast_compile  # XLA's backend optimizations off: conftest.py


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
