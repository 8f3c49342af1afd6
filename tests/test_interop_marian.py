"""Hugging Face interop for Marian: our ``EncoderDecoder`` matches ``transformers``'
``MarianMTModel`` logit for logit, with source padding.

Randomly initialised tiny HF models are saved with ``save_pretrained`` (also sharded), loaded with
``load_hf`` and compared to 1e-4 in float32; ``save_hf`` files are loaded back by
``from_pretrained``. ``torch`` and ``transformers`` come with the ``dev`` extra (CI installs it);
without them these tests skip, saying so.
"""

import os
import re

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hf_checkpoints import TOL, VOCAB, max_diff, randomize
from safetensors.numpy import load_file, save_file

from flaxformer_lite.interop import load_hf, save_hf
from flaxformer_lite.models import ModelConfig, build_model

pytestmark = pytest.mark.fast_compile  # XLA's backend optimizations off: conftest.py


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
