"""Hugging Face interop for BERT: our ``Encoder`` matches ``transformers``' ``BertForMaskedLM``
and ``BertForSequenceClassification`` logit for logit.

Randomly initialised tiny HF models are saved with ``save_pretrained``, loaded with ``load_hf``
and compared on random tokens with token types and padding (``attention_mask`` zeros) to 1e-4
in float32: masked-LM logits at the real tokens (those at padding are not part of the
contract), class logits whole. ``save_hf`` files are loaded back by ``from_pretrained``.
``torch`` and ``transformers`` come with the ``dev`` extra; without them those tests skip,
saying so. The error and call-convention tests need neither.
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hf_checkpoints import TOL, VOCAB, edit_config, max_diff, randomize
from safetensors.numpy import load_file, save_file

from flaxformer_lite.interop import SUPPORTED, bert, hf_arguments, load_hf, save_hf
from flaxformer_lite.models import ModelConfig, build_model

pytestmark = pytest.mark.fast_compile  # XLA's backend optimizations off: conftest.py


@pytest.fixture(scope="module")
def inputs():
    """HF's call arguments as a tokenizer gives them (int64 numpy, ``[2, 13]``): random ids,
    segment A then B (``token_type_ids``), and an ``attention_mask`` (1 real, 0 padding) with
    the second row padded (pad id 0) after 8 tokens."""
    rng = np.random.default_rng(0)
    ids = rng.integers(1, VOCAB, (2, 13))
    token_type_ids = (np.arange(13) >= np.array([[6], [4]])).astype(np.int64)
    attention_mask = np.ones((2, 13), np.int64)
    attention_mask[1, 8:], ids[1, 8:], token_type_ids[1, 8:] = 0, 0, 0
    return dict(input_ids=ids, token_type_ids=token_type_ids, attention_mask=attention_mask)


INPUT_NAMES = ("input_ids", "token_type_ids", "attention_mask")


def hf_logits(hf, model, inputs):
    with hf.torch.no_grad():
        return model(**{k: hf.torch.as_tensor(v) for k, v in inputs.items()}).logits.numpy()


def call(method, inputs, to=np.asarray):
    """``method`` called with HF's arguments (``input_ids``, ``token_type_ids``,
    ``attention_mask``) as ours, each array passed through ``to``."""
    return method(**hf_arguments(**{k: to(inputs[k]) for k in INPUT_NAMES}))


def logit_diff(ours, theirs, inputs):
    """The largest difference, over the real tokens for masked-LM logits ``[B, T, V]``, over
    all for class logits ``[B, C]``."""
    ours, theirs = np.asarray(ours), np.asarray(theirs)
    assert ours.shape == theirs.shape
    if ours.ndim == 3:
        real = inputs["attention_mask"] == 1
        ours, theirs = ours[real], theirs[real]
    return max_diff(ours, theirs)


# --------------------------------------------------------------------------- HF checkpoints
BERT_VARIANTS = {
    # bert-base's shape: exact GELU, the decoder tied to the word embeddings.
    "mlm-tied": ("BertForMaskedLM", dict()),
    # A decoder of its own (its bias is cls.predictions.decoder.bias), three segment types.
    "mlm-untied-gelu_new": (
        "BertForMaskedLM",
        dict(tie_word_embeddings=False, hidden_act="gelu_new", type_vocab_size=3),
    ),
    "classifier-3": ("BertForSequenceClassification", dict(num_labels=3)),
    "regression-relu": ("BertForSequenceClassification", dict(num_labels=1, hidden_act="relu")),
}


@pytest.fixture(scope="module", params=sorted(BERT_VARIANTS))
def bert_dir(request, hf, tmp_path_factory):
    """A saved random tiny BERT: ``(hf_model, path)``."""
    architecture, overrides = BERT_VARIANTS[request.param]
    config = hf.transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=96,
        max_position_embeddings=64,
        **overrides,
    )
    model = randomize(hf.torch, getattr(hf.transformers, architecture)(config))
    path = tmp_path_factory.mktemp(f"bert-{request.param}")
    model.save_pretrained(path)
    return model, path


def check_load(hf, hf_model, path, inputs):
    """``load_hf(path)`` gives ``hf_model``'s logits for HF's arguments, for numpy and jax ints
    and for our own arguments alike; returns our model and config."""
    model, cfg = load_hf(path)
    logits = call(model, inputs)
    assert logit_diff(logits, hf_logits(hf, hf_model, inputs), inputs) < TOL
    as_jax = call(model, inputs, to=lambda x: jnp.asarray(x, jnp.int32))
    assert max_diff(as_jax, logits) == 0.0
    ours = model(
        inputs["input_ids"],
        token_types=inputs["token_type_ids"],
        padding_mask=inputs["attention_mask"] == 1,
    )
    assert max_diff(ours, logits) == 0.0
    return model, cfg


def test_bert_load_matches_hf(hf, bert_dir, inputs):
    hf_model, path = bert_dir
    model, cfg = check_load(hf, hf_model, path, inputs)
    hf_config = hf_model.config
    assert (cfg.kind, cfg.norm_position, cfg.positions, cfg.embed_norm) == (
        "encoder",
        "post",
        "learned",
        True,
    )
    assert cfg.type_vocab_size == hf_config.type_vocab_size
    if type(hf_model).__name__ == "BertForSequenceClassification":
        # No masked-LM head in the checkpoint: none in our model (the tied table is not one).
        assert cfg.num_classes == hf_config.num_labels
        assert not cfg.mlm_transform and not cfg.output_bias and cfg.tie_embeddings
        assert model.head.transform is None and model.head.bias is None
        assert max_diff(call(model.classify, inputs), call(model, inputs)) == 0.0
    else:
        assert cfg.num_classes is None and cfg.mlm_transform and cfg.output_bias
        assert cfg.tie_embeddings == hf_config.tie_word_embeddings


def check_save(hf, model, cfg, path, inputs):
    """``save_hf`` files load in ``transformers`` as the architecture ``cfg`` implies (no
    missing or unused tensors) and give our logits."""
    save_hf(model, cfg, path)
    assert sorted(os.listdir(path)) == ["config.json", "model.safetensors"]
    architecture = "BertForSequenceClassification" if cfg.num_classes else "BertForMaskedLM"
    auto = (
        hf.transformers.AutoModelForSequenceClassification
        if cfg.num_classes
        else hf.transformers.AutoModelForMaskedLM
    )
    hf_model, info = auto.from_pretrained(path, output_loading_info=True)
    assert type(hf_model).__name__ == architecture
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    expected = hf_logits(hf, hf_model.float().eval(), inputs)
    assert logit_diff(call(model, inputs), expected, inputs) < TOL


def test_bert_save_round_trip(hf, bert_dir, inputs, tmp_path):
    model, cfg = load_hf(bert_dir[1])
    check_save(hf, model, cfg, tmp_path, inputs)
    assert load_hf(tmp_path)[1] == cfg


def test_bert_base_config_is_our_preset(hf):
    """HF's default ``BertConfig`` (bert-base-uncased's shape) reads as our ``bert-base``."""
    hf_config = hf.transformers.BertConfig().to_dict()
    cfg = bert.config_from_hf({**hf_config, "architectures": ["BertForMaskedLM"]})
    assert cfg == ModelConfig.from_preset("bert-base")


@pytest.mark.parametrize("bert_dir", ["mlm-tied"], indirect=True)
def test_bert_loads_pretraining_conversions(hf, bert_dir, inputs, tmp_path):
    """Checkpoints converted from ``BertForPreTraining`` (as ``bert-base-uncased``) hold the
    pooler, the next-sentence head, the position-id buffer and the tied decoder, and older ones
    call LayerNorm parameters ``gamma``/``beta``: all load to the same masked LM."""
    hf_model, path = bert_dir
    tensors = load_file(path / "model.safetensors")
    rng = np.random.default_rng(0)
    tensors.update(
        {
            "bert.pooler.dense.weight": rng.normal(size=(64, 64)).astype(np.float32),
            "bert.pooler.dense.bias": np.zeros(64, np.float32),
            "cls.seq_relationship.weight": rng.normal(size=(2, 64)).astype(np.float32),
            "cls.seq_relationship.bias": np.zeros(2, np.float32),
            "bert.embeddings.position_ids": np.arange(64)[None],
            "cls.predictions.decoder.weight": tensors["bert.embeddings.word_embeddings.weight"],
        }
    )
    renamed = {
        name.removesuffix(".weight") + ".gamma"
        if "LayerNorm.weight" in name
        else name.removesuffix(".bias") + ".beta"
        if "LayerNorm.bias" in name
        else name: x
        for name, x in tensors.items()
    }
    assert "bert.embeddings.LayerNorm.gamma" in renamed
    save_file(renamed, tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    model, _ = load_hf(tmp_path)
    assert logit_diff(call(model, inputs), hf_logits(hf, hf_model, inputs), inputs) < TOL
    edit_config(tmp_path, architectures=None)  # older configs name only the model type
    assert max_diff(call(load_hf(tmp_path)[0], inputs), call(model, inputs)) == 0.0


# --------------------------------------------------------------------------- our own models
@pytest.mark.parametrize(
    "overrides",
    [
        dict(),  # the preset: BertForMaskedLM
        dict(scan_layers=True),  # layers stacked on one axis, split back out
        # A classifier whose config keeps the masked-LM head: saved without it.
        dict(num_classes=3, scan_layers=True),
    ],
    ids=["mlm", "mlm-scanned", "classifier-scanned"],
)
def test_save_hf_of_our_bert_tiny(hf, inputs, tmp_path, overrides):
    cfg = ModelConfig.from_preset("bert-tiny", **overrides)
    model = build_model(cfg, rngs=nnx.Rngs(1))
    model.eval()
    model.head.bias[...] = jnp.linspace(-1.0, 1.0, cfg.vocab_size)  # zero at init: make it count
    if cfg.num_classes:  # class logits are ~0.05 at init: make them O(1)
        kernel = model.classifier.kernel
        kernel[...] = jax.random.normal(jax.random.key(0), kernel.shape)
    check_save(hf, model, cfg, tmp_path, inputs)
    loaded, loaded_cfg = load_hf(tmp_path)
    assert logit_diff(call(loaded, inputs), call(model, inputs), inputs) < TOL
    if cfg.num_classes:
        assert loaded_cfg == cfg.replace(mlm_transform=False, output_bias=False, scan_layers=False)
    else:
        assert loaded_cfg == cfg.replace(scan_layers=False)


# --------------------------------------------------------------------------- errors
@pytest.fixture
def tiny_bert_dir(tmp_path):
    """A masked-LM checkpoint written by ``save_hf`` (no torch needed)."""
    cfg = ModelConfig.from_preset("bert-tiny")
    save_hf(build_model(cfg, rngs=nnx.Rngs(0)), cfg, tmp_path)
    return tmp_path


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(position_embedding_type="relative_key"), "position_embedding_type='relative_key'"),
        (dict(is_decoder=True), "is_decoder=true"),
        (dict(add_cross_attention=True), "add_cross_attention=true"),
        (dict(hidden_act="gelu_10"), "hidden_act='gelu_10'"),
        (dict(type_vocab_size=0), "type_vocab_size=0"),
        (
            dict(architectures=["BertForSequenceClassification"], id2label={}, num_labels=0),
            "num_labels=0",
        ),
    ],
)
def test_unsupported_bert_settings_are_named(tiny_bert_dir, changes, message):
    edit_config(tiny_bert_dir, **changes)
    with pytest.raises(ValueError, match=message):
        load_hf(tiny_bert_dir)


def test_missing_bert_key_and_tensors_are_named(tiny_bert_dir):
    config = json.loads((tiny_bert_dir / "config.json").read_text())
    del config["hidden_size"]
    (tiny_bert_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="lacks the bert key 'hidden_size'"):
        load_hf(tiny_bert_dir)
    # A masked-LM checkpoint read as a classifier lacks the pooler and classifier.
    edit_config(tiny_bert_dir, hidden_size=64, architectures=["BertForSequenceClassification"])
    with pytest.raises(ValueError, match=r"lacks.*bert\.pooler\.dense\.bias"):
        load_hf(tiny_bert_dir)


def test_unknown_bert_architecture_lists_supported(tiny_bert_dir):
    edit_config(tiny_bert_dir, architectures=["BertForTokenClassification"])
    with pytest.raises(ValueError, match="BertForTokenClassification") as error:
        load_hf(tiny_bert_dir)
    assert {"BertForMaskedLM", "BertForSequenceClassification"} <= set(SUPPORTED)
    assert all(name in str(error.value) for name in SUPPORTED)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(mlm_transform=False), "mlm_transform=False"),
        (dict(output_bias=False), "output_bias=False"),
        (dict(num_classes=2, pooling="mean"), "pooling='mean'"),
        (dict(num_classes=2, pooler_dense=False), "pooler_dense=False"),
        (dict(type_vocab_size=0), "type_vocab_size=0"),
        (dict(positions="rope"), "positions='rope'"),
        (dict(embedding_dropout=0.0), "embedding_dropout=0.0 != residual_dropout=0.1"),
    ],
)
def test_save_hf_names_what_bert_cannot_represent(tmp_path, overrides, message):
    cfg = ModelConfig.from_preset("bert-tiny", **overrides)
    assert any(message in problem for problem in bert.mismatches(cfg))
    bert_part = (
        f"closest BertForMaskedLM/BertForSequenceClassification, which differs in .*{message}"
    )
    with pytest.raises(ValueError, match=bert_part):
        save_hf(build_model(cfg, rngs=nnx.Rngs(0)), cfg, tmp_path)


# --------------------------------------------------------------------------- call convention
def test_hf_arguments_are_ours(inputs):
    """``attention_mask`` (int 0/1 or bool) is our bool ``padding_mask``, ``token_type_ids`` our
    ``token_types``; the models take only our names; a classifier's call is ``classify``."""
    cfg = ModelConfig.from_preset("bert-tiny", num_encoder_layers=1)
    model = build_model(cfg, rngs=nnx.Rngs(0))
    model.eval()
    ids, segments, attention = (inputs[k] for k in INPUT_NAMES)
    arguments = hf_arguments(ids, attention_mask=attention, token_type_ids=segments)
    assert sorted(arguments) == ["inputs", "padding_mask", "token_types"]
    np.testing.assert_array_equal(arguments["padding_mask"], attention == 1)
    ours = model(ids, token_types=segments, padding_mask=attention == 1)
    assert max_diff(model(**arguments), ours) == 0.0
    as_bool = hf_arguments(ids, attention_mask=attention == 1, token_type_ids=segments)
    assert max_diff(model(**as_bool), ours) == 0.0
    assert max_diff(model(**hf_arguments(ids, token_type_ids=segments)), ours) > 1e-3  # mask
    assert max_diff(model(**hf_arguments(ids, attention_mask=attention)), ours) > 1e-3  # types
    assert sorted(hf_arguments(ids)) == ["inputs"]
    with pytest.raises(ValueError, match=r"attention_mask must be .*\[2, 13\].*\(2, 12\)"):
        hf_arguments(ids, attention_mask=attention[:, 1:])
    with pytest.raises(ValueError, match=r"attention_mask must be .*float32"):
        hf_arguments(ids, attention_mask=attention.astype(np.float32))
    with pytest.raises(ValueError, match=r"token types must be int \[2, 13\]"):
        model(**hf_arguments(ids, token_type_ids=segments[:1]))
    for name in ("attention_mask", "token_type_ids", "mask"):  # no other names
        with pytest.raises(TypeError, match=name):
            model(ids, **{name: attention})

    classifier = build_model(cfg.replace(num_classes=3), rngs=nnx.Rngs(0))
    classifier.eval()
    logits = classifier(**arguments)
    assert logits.shape == (2, 3)
    assert (
        max_diff(
            classifier.classify(ids, token_types=segments, padding_mask=attention == 1), logits
        )
        == 0.0
    )

    no_types = build_model(cfg.replace(type_vocab_size=0), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="type_vocab_size > 0"):
        no_types(ids, token_types=segments)
