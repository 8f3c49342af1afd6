"""Hugging Face interop errors and checkpoint layouts: what ``load_hf`` cannot read and what
``save_hf`` cannot write is named (the missing file, tensor or setting), and checkpoints in older
layouts load. These tests write their checkpoints with ``save_hf``: no ``torch`` needed.
"""

import json
import pathlib
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hf_checkpoints import CORPUS, VOCAB, bpe_tokenizer, edit_config, max_diff
from safetensors import SafetensorError
from safetensors.numpy import load_file, save_file
from subprocess_env import subprocess_env

from flaxformer_lite.interop import SUPPORTED, common, load_hf, save_hf
from flaxformer_lite.models import ModelConfig, build_model

pytestmark = pytest.mark.fast_compile  # XLA's backend optimizations off: conftest.py

REPO = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def ids():
    """Random token ids ``[2, 13]``, int64 numpy (as a tokenizer gives them)."""
    return np.random.default_rng(0).integers(0, VOCAB, (2, 13))


@pytest.fixture
def tiny_gpt2_dir(tmp_path):
    """A checkpoint written by ``save_hf`` (no torch needed)."""
    cfg = ModelConfig.from_preset("gpt2-tiny")
    save_hf(build_model(cfg, rngs=nnx.Rngs(0)), cfg, tmp_path)
    return tmp_path


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


def spoil(file: pathlib.Path, how: str) -> None:
    """Cuts ``file`` to half its length (an interrupted download) or overwrites it with text."""
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2] if how == "truncated" else b"<html>Not Found</html>")


@pytest.mark.parametrize("how", ["truncated", "garbage"])
def test_a_spoilt_weights_file_is_named(tiny_gpt2_dir, how):
    single = tiny_gpt2_dir / "model.safetensors"
    spoil(single, how)
    with pytest.raises(ValueError, match=r"model\.safetensors is not a readable safetensors"):
        load_hf(tiny_gpt2_dir)
    shard = "model-00001-of-00001.safetensors"  # the same file as the one shard of an index
    single.rename(tiny_gpt2_dir / shard)
    index = {"weight_map": {"transformer.wte.weight": shard}}
    (tiny_gpt2_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=f"{shard} is not a readable safetensors"):
        load_hf(tiny_gpt2_dir)


@pytest.mark.parametrize("command", ["sample.py", "train.py"])
def test_commands_name_a_spoilt_weights_file_and_exit_2(tmp_path, command):
    """``generate --hf-dir`` and ``train.py init_from=`` print one line naming the file."""
    tokenizer = bpe_tokenizer()
    cfg = ModelConfig.from_preset("gpt2-tiny", vocab_size=tokenizer.get_vocab_size())
    checkpoint = tmp_path / "gpt2"
    save_hf(build_model(cfg, rngs=nnx.Rngs(0)), cfg, checkpoint)
    tokenizer.save(str(checkpoint / "tokenizer.json"))
    edit_config(checkpoint, bos_token_id=0, eos_token_id=0)  # <|endoftext|>
    spoil(checkpoint / "model.safetensors", "truncated")
    if command == "sample.py":
        args = ["--hf-dir", str(checkpoint), "--prompt", "hello"]
    else:
        (tmp_path / "corpus.txt").write_text("\n".join(CORPUS) + "\n")
        args = [
            f"init_from={checkpoint}",
            f"run_dir={tmp_path / 'run'}",
            "data.source=text",
            f"data.path={tmp_path / 'corpus.txt'}",
            "train.steps=1",
            "--no-progress",
        ]
    child = subprocess.run(
        [sys.executable, command, *args],
        cwd=REPO,
        env=subprocess_env(1),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert child.returncode == 2, child.stderr[-3000:]
    assert "Traceback" not in child.stderr, child.stderr[-3000:]
    last = child.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and f"{checkpoint}/model.safetensors" in last, last


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
    """Issue 45 item 2: what differs from the closest family, in a line; the others counted."""
    cfg = ModelConfig.from_preset("llama-tiny", rope_layout="interleaved")
    with pytest.raises(ValueError) as refused:
        save_hf(build_model(cfg, rngs=nnx.Rngs(0)), cfg, tmp_path)
    assert str(refused.value).startswith(
        "save_hf: no Hugging Face family fits; closest LlamaForCausalLM, which differs in "
        "rope_layout='interleaved' (Llama has 'half') (settings apart in the others: "
    )
    cfg = ModelConfig.from_preset("transformer-tiny")
    with pytest.raises(ValueError, match="closest MarianMTModel, which differs in norm_eps") as e:
        save_hf(build_model(cfg, rngs=nnx.Rngs(0)), cfg, tmp_path)
    assert len(str(e.value)) < 400 and "GPT-2 has" not in str(e.value)


def test_load_hf_dtype(tiny_gpt2_dir):
    model, cfg = load_hf(tiny_gpt2_dir, dtype="bfloat16")
    assert cfg.dtype == cfg.param_dtype == "bfloat16"
    assert model.embed.tokens.embedding[...].dtype == jnp.bfloat16
    with pytest.raises(ValueError, match="dtype"):
        load_hf(tiny_gpt2_dir, dtype="int8")


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


def test_a_weights_file_that_cannot_be_written_is_an_os_error_naming_it(tmp_path, monkeypatch):
    """Issue 43 item 11: export onto a full disk ended in a SafetensorError traceback."""

    def full_disk(_tensors, filename, metadata=None):
        pathlib.Path(filename).write_bytes(b"partial")
        raise SafetensorError("Error while serializing: No space left on device (os error 28)")

    monkeypatch.setattr(common, "save_file", full_disk)
    with pytest.raises(OSError, match="model.safetensors: cannot write .*No space left") as info:
        common.write_checkpoint(tmp_path, {}, {"w": np.zeros(3, np.float32)})
    assert str(tmp_path) in str(info.value)
    assert list(tmp_path.iterdir()) == []  # no partial file left


def test_the_weights_file_has_the_mode_of_the_other_files(tmp_path):
    """Issue 43 item 18: safetensors wrote model.safetensors 0600, config.json was 0644."""
    common.write_checkpoint(tmp_path, {}, {"w": np.zeros(3, np.float32)})
    modes = {p.name: p.stat().st_mode & 0o777 for p in tmp_path.iterdir()}
    assert modes["model.safetensors"] == modes["config.json"], modes
