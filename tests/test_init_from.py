"""``train.py init_from=PATH``: fine-tuning a Hugging Face checkpoint directory (a tiny random GPT-2
with a BPE tokenizer trained in the test, ``tests/hf_checkpoints.py``) on a local text file. The
first step's loss is checked against the loss ``transformers`` computes on the same batch, the
loss falls, a resumed run continues from its checkpoint (not from the checkpoint directory), the
fine-tuned run generates, and bad settings exit 2 naming the key."""

import json
import re
import shutil

import hf_checkpoints
import numpy as np
import pytest

from flaxformer_lite.cli import main
from flaxformer_lite.cli.train import train_main
from flaxformer_lite.data.hf_tokenizer import HfTokenizer, load_hf_tokenizer
from flaxformer_lite.data.pipeline import build_data
from flaxformer_lite.data.tasks import TASKS
from flaxformer_lite.decode.text import continue_or_translate
from flaxformer_lite.train.config import ConfigError, load_config
from flaxformer_lite.train.loop import run
from flaxformer_lite.train.run_dir import RunDir
from flaxformer_lite.train.trained_run import load_run

pytestmark = pytest.mark.fast_compile  # XLA's backend optimizations off: conftest.py

STEPS = 60
NO_DROPOUT = ["model.embedding_dropout=0", "model.attention_dropout=0", "model.residual_dropout=0"]


@pytest.fixture(scope="module")
def gpt2(hf, tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt2")
    return hf_checkpoints.gpt2_dir(hf.transformers, hf.torch, path), path


@pytest.fixture(scope="module")
def finetuned(gpt2, tmp_path_factory):
    """GPT-2 fine-tuned for 60 steps on a text file of one example per line (rows padded, not
    packed; dropout off)."""
    root = tmp_path_factory.mktemp("finetune")
    (root / "corpus.txt").write_text("\n".join(hf_checkpoints.CORPUS) + "\n")
    overrides = [
        f"init_from={gpt2[1]}",
        f"run_dir={root / 'run'}",
        "data.source=text",
        f"data.path={root / 'corpus.txt'}",
        "data.text_documents=lines",  # one example per line
        "data.seq_len=16",
        "data.packing=false",
        "train.batch_size=8",
        f"train.steps={STEPS}",
        "train.log_every=1",
        f"train.eval_every={STEPS}",
        "train.eval_batches=1",
        "optimizer.lr=1e-2",
        "optimizer.warmup_steps=0",
        "optimizer.schedule=constant",
        *NO_DROPOUT,
    ]
    logs = []
    run(load_config(None, overrides), progress=False, log=logs.append)
    return root, overrides, logs


def losses(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines) if "loss" in r}


def test_the_model_comes_from_config_json(gpt2, finetuned):
    hf_model, path = gpt2
    cfg = load_config(None, finetuned[1])
    assert cfg.init_from == str(path)
    assert (cfg.model.vocab_size, cfg.model.d_model) == (hf_model.config.vocab_size, 32)
    assert (cfg.model.num_decoder_layers, cfg.model.max_length) == (2, 64)
    assert cfg.model.residual_dropout == 0.0  # overridden; the checkpoint says 0.1
    assert load_config(None, [f"init_from={path}"]).model.residual_dropout == 0.1
    assert "initialized the model from" in "\n".join(finetuned[2])


def test_first_step_loss_is_the_hf_loss_and_it_falls(hf, gpt2, finetuned, tmp_path):
    """The first batch, rebuilt, through the HF model: its token-weighted cross-entropy equals
    our first step's loss (before any update); padding has weight 0, real <|endoftext|> 1."""
    torch = hf.torch
    root, overrides, _ = finetuned
    cfg = load_config(None, overrides)
    tokenizer = load_hf_tokenizer(gpt2[1])
    data = build_data(
        cfg.data,
        task=TASKS["lm"],
        seed=cfg.seed,
        batch_size=cfg.train.batch_size,
        directory=tmp_path / "tokenizer",
        prepared=tmp_path / "prepared",
        tokenizer=tokenizer,
    )
    batch = next(data.train)
    eot = tokenizer.eos_id
    starts = batch["inputs"][:, 0] == eot  # a line's first row starts with <|endoftext|>
    # A line longer than a row is not cut: it goes on in the next row, from position 0 (as the
    # HF model sees that row too), where the row before, full and without its end, stopped.
    assert starts[0] and not starts.all()
    for row in np.flatnonzero(~starts):
        assert batch["weights"][row - 1].all() and eot not in batch["targets"][row - 1]
    # Padding is id 0 with weight 0; here 0 is <|endoftext|> itself, whose real occurrences (the
    # targets closing each example) keep weight 1.
    padding = batch["weights"] == 0
    assert eot == 0 and padding.any() and (batch["targets"][padding] == 0).all()
    assert ((batch["targets"] == eot) & ~padding).sum() >= len(padding) // 2
    with torch.no_grad():
        logits = gpt2[0](torch.as_tensor(batch["inputs"], dtype=torch.long)).logits
        nll = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]),
            torch.as_tensor(batch["targets"].reshape(-1), dtype=torch.long),
            reduction="none",
        ).numpy()
    weights = batch["weights"].reshape(-1)
    expected = float((nll * weights).sum() / weights.sum())
    recorded = losses(root / "run")
    assert recorded[1] == pytest.approx(expected, rel=1e-5, abs=1e-5)
    assert np.mean([recorded[s] for s in range(STEPS - 4, STEPS + 1)]) < 0.5 * recorded[1]


def test_resume_continues_from_the_checkpoint(finetuned):
    root, overrides, _ = finetuned
    logs = []
    run(
        load_config(None, [*overrides, f"train.steps={STEPS + 4}"]), progress=False, log=logs.append
    )
    text = "\n".join(logs)
    assert f"resumed from step {STEPS}" in text and "initialized the model" not in text
    recorded = losses(root / "run")
    assert recorded[STEPS + 1] < 0.5 * recorded[1]  # not the checkpoint directory's weights
    assert load_run(root / "run").step == STEPS + 4


def test_the_finetuned_run_generates(finetuned, capsys):
    run_dir = finetuned[0] / "run"
    loaded = load_run(run_dir)
    assert isinstance(loaded.tokenizer, HfTokenizer)
    [new] = continue_or_translate(
        loaded.model, loaded.tokenizer, ["the quick"], add_bos=True, max_new_tokens=8
    )
    assert (
        main(
            [
                "generate",
                "--run_dir",
                str(run_dir),
                "--prompt",
                "the quick",
                "--max_new_tokens",
                "8",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert out == f"the quick{loaded.tokenizer.decode(new)}\n"
    assert "brown fox" in out  # learnt from the corpus


def test_the_run_config_yaml_loads_back(finetuned, tmp_path):
    """The resolved config.yaml a run writes (init_from and the checkpoint's model) is a valid
    --config; a model value changed in it is still refused."""
    saved = finetuned[0] / "run" / "config.yaml"
    cfg = load_config(saved, ["train.steps=3"])
    assert cfg.model == load_config(None, finetuned[1]).model and cfg.train.steps == 3
    older = tmp_path / "older.yaml"  # as runs before derived values were resolved wrote it
    older.write_text(re.sub(r"(num_kv_heads|head_dim): \d+", r"\1: null", saved.read_text()))
    assert "num_kv_heads: null" in older.read_text()
    assert load_config(older, []).model == cfg.model
    changed = tmp_path / "changed.yaml"
    changed.write_text(saved.read_text().replace("num_heads: 2", "num_heads: 4"))
    with pytest.raises(ConfigError, match=r"model\.num_heads cannot be set with init_from"):
        load_config(changed, [])


def test_bad_init_from_settings_name_the_key(gpt2, tmp_path, capsys):
    path = gpt2[1]
    with pytest.raises(ConfigError, match=r"model\.num_heads cannot be set with init_from"):
        load_config(None, [f"init_from={path}", "model.num_heads=4"])
    with pytest.raises(ConfigError, match=r"model\.preset cannot be set"):
        load_config(None, [f"init_from={path}", "model.preset=gpt2-tiny"])
    with pytest.raises(ConfigError, match=r"data\.tokenizer cannot be set with init_from"):
        load_config(None, [f"init_from={path}", "data.tokenizer=bpe"])
    # Not set, as the config.yaml of a run from a prepared store records it.
    (tmp_path / "store.yaml").write_text(
        f"init_from: {path}\ndata: {{source: prepared, path: store, tokenizer: null}}\n"
    )
    assert load_config(tmp_path / "store.yaml").data.tokenizer is None
    assert train_main([f"init_from={tmp_path / 'missing'}", f"run_dir={tmp_path}/r"]) == 2
    err = capsys.readouterr().err
    assert "init_from=" in err and "does not exist" in err
    (tmp_path / "t5").mkdir()
    (tmp_path / "t5" / "config.json").write_text(
        json.dumps({"architectures": ["T5ForConditionalGeneration"], "model_type": "t5"})
    )
    assert train_main([f"init_from={tmp_path / 't5'}", f"run_dir={tmp_path}/r"]) == 2
    err = capsys.readouterr().err
    assert "unsupported Hugging Face architecture" in err and "GPT2LMHeadModel" in err
    # A checkpoint without a tokenizer: exit 2 naming the directory and the files looked for.
    (tmp_path / "bare").mkdir()
    (tmp_path / "bare" / "config.json").write_text((path / "config.json").read_text())
    assert (
        train_main(
            [
                f"init_from={tmp_path / 'bare'}",
                f"run_dir={tmp_path}/r",
                "train.steps=1",
                "--no-progress",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert str(tmp_path / "bare") in err and "tokenizer.json" in err


def test_a_saved_tokenizer_of_another_checkpoint_is_refused(gpt2, tmp_path, capsys):
    """A run directory left with another checkpoint's tokenizer (a first run that failed before
    its first checkpoint) is not trained with the wrong ids."""
    other = tmp_path / "other"
    shutil.copytree(gpt2[1], other)
    (other / "tokenizer.json").write_text(hf_checkpoints.bpe_tokenizer(vocab_size=280).to_str())
    with RunDir(tmp_path / "run").locked():  # as the failed run left it
        load_hf_tokenizer(other).save(tmp_path / "run" / "tokenizer")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(hf_checkpoints.CORPUS) + "\n")
    argv = [
        f"init_from={gpt2[1]}",
        f"run_dir={tmp_path / 'run'}",
        "data.source=text",
        f"data.path={corpus}",
        "train.steps=1",
        "--no-progress",
    ]
    assert train_main(argv) == 2
    assert "another checkpoint's tokenizer" in capsys.readouterr().err
