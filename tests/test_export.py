"""``flaxformer-lite export`` (issue 36): a trained run, of each tokenizer, as a Hugging Face
directory that ``transformers`` loads offline with its Auto classes and ``AutoTokenizer``: the
same ids, the same logits (1e-4), the same greedy text as ``generate`` on the run; a masked LM
and an encoder-decoder too; models without a Hugging Face counterpart refused with one line.

Each tiny run trains a few steps, once per module (the runs compile for a few seconds each)."""

import json
import shutil
import socket
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from subprocess_env import subprocess_env

from flaxformer_lite.cli import main
from flaxformer_lite.train.config import load_config
from flaxformer_lite.train.export import export_run
from flaxformer_lite.train.loop import run
from flaxformer_lite.train.trained_run import load_run

pytestmark = pytest.mark.fast_compile  # XLA's backend optimizations off: conftest.py

NAMES = ("byte", "char", "word", "bpe", "sentencepiece")
LINES = [
    "the quick brown fox jumps over the lazy dog.",
    "a lazy dog sleeps, the quick fox runs!",
    "over and over: the fox, the dog, the end.",
]
PROMPTS = ["the quick", "a lazy dog"]
TINY = [
    "model.num_decoder_layers=1",
    "train.steps=12",
    "checkpoint.every=12",
    "train.batch_size=8",
    "data.seq_len=32",
    "optimizer.lr=0.01",
    "optimizer.warmup_steps=0",
    "train.log_every=12",
    "train.eval_every=12",
    "train.eval_batches=1",
    "data.eval_size=8",
    "train.decode_examples=0",
]
ROUND_TRIP = {}  # tokenizer name -> max |logit difference|, printed at the end (pytest -s)


def train(run_dir, overrides, config=None):
    run(load_config(config, [f"run_dir={run_dir}", *overrides]), progress=False, log=lambda _: 0)
    return run_dir


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A text file of the lines, and a SentencePiece model trained on them."""
    import sentencepiece

    root = tmp_path_factory.mktemp("corpus")
    (root / "corpus.txt").write_text("\n".join(LINES * 40) + "\n")
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(LINES * 40),
        model_prefix=str(root / "spm"),
        vocab_size=40,
        hard_vocab_limit=False,
        minloglevel=2,
    )
    return root


@pytest.fixture(scope="module", params=NAMES)
def lm_export(request, corpus, tmp_path_factory):
    """A tiny decoder LM trained with tokenizer ``name`` on the corpus, and its export."""
    name, root = request.param, tmp_path_factory.mktemp(request.param)
    options = {
        "bpe": ["data.vocab_size=280"],
        "sentencepiece": [f"data.tokenizer_path={corpus}/spm.model"],
    }
    run_dir = train(
        root / "run",
        [
            "data.source=text",
            f"data.path={corpus / 'corpus.txt'}",
            "data.text_documents=lines",
            f"data.tokenizer={name}",
            *options.get(name, []),
            *TINY,
        ],
    )
    export_run(run_dir, root / "hf")
    yield name, run_dir, root / "hf"
    if len(ROUND_TRIP) == len(NAMES) and name == NAMES[-1]:
        print("\nexport round trip, max |logit difference|:", ROUND_TRIP)


def hf_model(hf, auto_class, path):
    model = getattr(hf.transformers, auto_class).from_pretrained(path, local_files_only=True)
    tokenizer = hf.transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    return model.eval(), tokenizer


def generated(argv, capsys):
    """The samples ``flaxformer-lite generate ARGV`` prints, one line each (the line of dashes
    between two left out)."""
    capsys.readouterr()
    assert main(["generate", *argv]) == 0
    return [line for line in capsys.readouterr().out.splitlines() if line != "-" * 16]


@pytest.mark.slow
def test_export_loads_in_transformers_as_the_run(hf, lm_export, capsys):
    name, run_dir, path = lm_export
    config = json.loads((path / "config.json").read_text())
    generation = json.loads((path / "generation_config.json").read_text())
    ours = load_run(run_dir)
    tokenizer = ours.tokenizer
    ids = {"bos_token_id": tokenizer.sos_id, "eos_token_id": tokenizer.eos_id}
    assert {**ids, "pad_token_id": tokenizer.pad_id}.items() <= config.items()
    assert ids.items() <= generation.items()
    assert config["vocab_size"] == tokenizer.vocab_size

    model, hf_tokenizer = hf_model(hf, "AutoModelForCausalLM", path)
    texts = []
    worst = 0.0
    for prompt in PROMPTS:
        prompt_ids = hf_tokenizer(prompt).input_ids
        assert prompt_ids == [tokenizer.sos_id, *tokenizer.encode(prompt)], name
        logits = np.asarray(ours.model(jnp.asarray([prompt_ids])))
        with hf.torch.no_grad():
            theirs = model(hf.torch.tensor([prompt_ids])).logits.numpy()
        worst = max(worst, float(np.abs(logits - theirs).max()))
        out = model.generate(
            hf.torch.tensor([prompt_ids]),
            attention_mask=hf.torch.ones(1, len(prompt_ids), dtype=hf.torch.long),
            max_new_tokens=12,
            do_sample=False,
        )
        texts.append(
            prompt + hf_tokenizer.decode(out[0, len(prompt_ids) :], skip_special_tokens=True)
        )
    ROUND_TRIP[name] = worst
    assert [text[len(prompt) :] for text, prompt in zip(texts, PROMPTS, strict=True)] != [""] * 2
    assert worst < 1e-4, name
    flags = [f for p in PROMPTS for f in ("--prompt", p)] + ["--max-new-tokens", "12"]
    assert generated(["--run-dir", str(run_dir), *flags], capsys) == texts
    assert generated(["--hf-dir", str(path), *flags], capsys) == texts


@pytest.mark.slow
def test_masked_lm_export_loads_as_auto_model_for_masked_lm(hf, corpus, tmp_path):
    run_dir = train(
        tmp_path / "run",
        [
            "model.preset=bert-tiny",
            "model.num_encoder_layers=1",
            "data.source=text",
            f"data.path={corpus / 'corpus.txt'}",
            "data.text_documents=lines",
            "data.tokenizer=word",
            *TINY[1:],
        ],
    )
    exported = export_run(run_dir, tmp_path / "hf")
    assert (exported.architecture, exported.auto_class) == (
        "BertForMaskedLM",
        "AutoModelForMaskedLM",
    )
    model, hf_tokenizer = hf_model(hf, exported.auto_class, exported.path)
    ours = load_run(run_dir)
    text = "the lazy fox"
    inputs = hf_tokenizer(text, return_tensors="pt")
    ids = inputs.input_ids[0].tolist()
    assert ids == [1, *ours.tokenizer.encode(text), 2]  # as our masked-LM rows: <sos> text <eos>
    assert hf_tokenizer.mask_token_id == 3  # <unk>, the id our masked-LM rows mask with
    with hf.torch.no_grad():
        theirs = model(**inputs).logits.numpy()
    logits = np.asarray(ours.model(jnp.asarray([ids])))
    assert np.abs(logits - theirs).max() < 1e-4


@pytest.mark.slow
def test_encoder_decoder_export_translates_as_the_run(hf, trained_translation, tmp_path, capsys):
    run_dir = trained_translation[0]  # conftest.py: Marian's conventions, 1 + 1 scanned layers
    exported = export_run(run_dir, tmp_path / "hf")
    assert exported.auto_class == "AutoModelForSeq2SeqLM"
    model, hf_tokenizer = hf_model(hf, exported.auto_class, exported.path)
    ours = load_run(run_dir)
    source, target = "three hundred forty-two", "342"
    src = hf_tokenizer(source).input_ids
    assert src == [*ours.tokenizer.encode(source), 2]  # as our sources: text <eos>
    tgt = [1, *ours.tokenizer.encode(target)]
    with hf.torch.no_grad():
        theirs = model(
            input_ids=hf.torch.tensor([src]), decoder_input_ids=hf.torch.tensor([tgt])
        ).logits.numpy()
    logits = np.asarray(ours.model(jnp.asarray([src]), jnp.asarray([tgt])))
    assert np.abs(logits - theirs).max() < 1e-4
    out = model.generate(hf.torch.tensor([src]), max_new_tokens=12, do_sample=False)
    text = f"{source} -> {hf_tokenizer.decode(out[0], skip_special_tokens=True)}"
    flags = ["--prompt", source, "--max-new-tokens", "12"]
    assert generated(["--run-dir", str(run_dir), *flags], capsys) == [text]
    assert generated(["--hf-dir", str(exported.path), *flags], capsys) == [text]


def test_save_hf_writes_the_tokenizer_ids(tmp_path):
    """Given the tokenizer's ids, config.json and generation_config.json carry them (not
    GPT-2's 50256 in a vocabulary of 260, not Marian's OPUS-MT ids); without, no generation
    config is written, as before."""
    from flax import nnx

    from flaxformer_lite.interop import save_hf
    from flaxformer_lite.models import ModelConfig, build_model

    ids = {"pad": 0, "bos": 1, "eos": 2}
    marian = dict(norm_eps=1e-5, sinusoidal_layout="concat", output_bias=True)
    for preset, extra in (("gpt2-tiny", {}), ("transformer-tiny", marian)):
        cfg = ModelConfig.from_preset(preset, **extra)
        model = build_model(cfg, rngs=nnx.Rngs(0))
        save_hf(model, cfg, tmp_path / preset, special_ids=ids)
        config = json.loads((tmp_path / preset / "config.json").read_text())
        generation = json.loads((tmp_path / preset / "generation_config.json").read_text())
        expected = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
        if preset == "transformer-tiny":
            expected["decoder_start_token_id"] = 1
            assert config["forced_eos_token_id"] is None
        assert generation == expected and expected.items() <= config.items()
        save_hf(model, cfg, tmp_path / f"{preset}-plain")
        assert not (tmp_path / f"{preset}-plain" / "generation_config.json").exists()


def export_command(*args):
    code = "import sys; from flaxformer_lite.cli import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run(
        [sys.executable, "-c", code, "export", *map(str, args)],
        capture_output=True,
        text=True,
        env=subprocess_env(1),
        timeout=120,
    )


@pytest.mark.slow
def test_a_model_without_a_hugging_face_counterpart_is_refused(tmp_path, capsys):
    """A run of one step has the checkpoint the refusal reads. (The command's exit status from
    a process of its own: test_export_refuses_a_directory_in_use_and_a_missing_run.)"""
    one_step = [*TINY, "train.steps=1", "checkpoint.every=1"]
    run_dir = train(tmp_path / "run", ["model.mixer=aft_simple", *one_step])
    capsys.readouterr()
    assert main(["export", "--run-dir", str(run_dir), "--out", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    (line,) = [line for line in err.splitlines() if line.startswith("error:")]
    assert line.startswith(f"error: export of {run_dir}: model.mixer=aft_simple")
    assert "has no Hugging Face counterpart" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # nothing written, nothing left


def test_export_refuses_a_directory_in_use_and_a_missing_run(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    child = export_command("--run-dir", tmp_path / "run", "--out", out)
    assert (child.returncode, child.stdout) == (2, "")
    assert child.stderr.splitlines()[-1] == (
        f"error: {out} exists and is not an empty directory; export writes a new one"
    )
    assert [p.name for p in out.iterdir()] == ["notes.txt"]
    assert main(["export", "--run-dir", str(tmp_path / "run"), "--out", str(tmp_path / "new")]) == 2
    assert capsys.readouterr().err == f"error: {tmp_path / 'run'}: no such run directory\n"
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize("family", ["gpt2", "llama", "marian"])
def test_a_checkpoint_tokenizer_exports_as_transformers_reads_it(hf, family, tmp_path):
    """A run fine-tuned from a Hugging Face checkpoint keeps its tokenizer (saved as ``hf``); its
    export reads in AutoTokenizer with the ids our rows have: a decoder LM's prompt starts with
    ``sos`` (GPT-2's tokenizer adds none: the export's does), a Marian source ends with eos."""
    import hf_checkpoints

    from flaxformer_lite.data.hf_tokenizer import load_hf_tokenizer
    from flaxformer_lite.data.tasks import TASKS
    from flaxformer_lite.data.tokenizer_export import hf_tokenizer_files

    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    if family == "marian":
        sentencepiece = pytest.importorskip("sentencepiece")
        hf_checkpoints.marian_dir(hf.transformers, hf.torch, sentencepiece, checkpoint)
    else:
        getattr(hf_checkpoints, f"{family}_dir")(hf.transformers, hf.torch, checkpoint)
    ours = load_hf_tokenizer(checkpoint)
    task = TASKS["seq2seq" if family == "marian" else "lm"]
    out = tmp_path / "export"
    out.mkdir()
    for name, content in hf_tokenizer_files(ours, task=task, max_length=64).items():
        (out / name).write_bytes(content)
    exported = hf.transformers.AutoTokenizer.from_pretrained(out, local_files_only=True)
    for text in ("hello world", "the lazy fox"):
        ids = ours.encode(text)
        expected = [*ids, ours.eos_id] if task.name == "seq2seq" else [ours.sos_id, *ids]
        assert exported(text).input_ids == expected
        assert exported.decode(expected, skip_special_tokens=True) == ours.decode(expected)
    assert (exported.eos_token_id, exported.pad_token_id) == (ours.eos_id, ours.pad_id)


def test_export_out_inside_a_run_is_refused_and_a_link_is_followed(trained_runs, tmp_path, capsys):
    """Issue 43 item 15: RUN/checkpoints/30 looked like step 30 of the run; a link to an empty
    directory failed with [Errno 20] Not a directory."""
    run_dir = tmp_path / "run"
    shutil.copytree(trained_runs("tiny"), run_dir)
    for out in (run_dir / "checkpoints" / "30", run_dir / "exports" / "default"):
        assert main(["export", "--run-dir", str(run_dir), "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert err == (
            f"error: {out} is inside the run directory {run_dir}: an export there would read "
            "as part of the run; choose a directory outside it\n"
        )
        assert not out.exists()
    (tmp_path / "target").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "target")
    # Issue 43 item 18: an export killed (kill -9) left its staging directory forever.
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], stdout=-1)
    stale = tmp_path / f".target.export-{socket.gethostname()}-{int(gone.stdout)}"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"partial")
    capsys.readouterr()
    assert main(["export", "--run-dir", str(run_dir), "--out", str(tmp_path / "link")]) == 0
    assert (tmp_path / "link").is_symlink() and (tmp_path / "target" / "config.json").is_file()
    # learned positions: transformers' generate cannot go past them, ours slides.
    rows = load_config(run_dir / "config.yaml").model.max_length
    assert capsys.readouterr().out.strip().splitlines()[-1] == (
        f"note: its position table has {rows} rows: transformers' generate fails past {rows} "
        "tokens (an IndexError), where flaxformer-lite generate slides its window"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "run", "target"]


@pytest.mark.slow
def test_the_shakespeare_char_recipe_exports_and_writes_the_same_greedy_text(hf, tmp_path, capsys):
    """Issue 45 item 2: the recipe has no biases, which a GPT-2 holds as zeros; a tiny run of
    it exports and transformers' greedy text is ours."""
    run_dir = train(
        tmp_path / "run",
        [*TINY[1:], "model.num_decoder_layers=2", "data.seq_len=64"],
        config="shakespeare_char",
    )
    export_run(run_dir, tmp_path / "hf")
    model, hf_tokenizer = hf_model(hf, "AutoModelForCausalLM", tmp_path / "hf")
    texts = []
    for prompt in ("ROMEO:", "First Citizen:"):
        prompt_ids = hf_tokenizer(prompt).input_ids
        out = model.generate(
            hf.torch.tensor([prompt_ids]),
            attention_mask=hf.torch.ones(1, len(prompt_ids), dtype=hf.torch.long),
            max_new_tokens=20,
            do_sample=False,
        )
        texts.append(
            prompt + hf_tokenizer.decode(out[0, len(prompt_ids) :], skip_special_tokens=True)
        )
    flags = ["--prompt", "ROMEO:", "--prompt", "First Citizen:", "--max-new-tokens", "20"]
    ours = generated(["--run-dir", str(run_dir), *flags], capsys)
    assert ours == texts
    # Issue 45 item 1: 500 characters from the 64-position model (greedy: sampling may draw a
    # special id, which decodes to no character).
    flags = ["--prompt", "ROMEO:", "--max-new-tokens", "500"]
    assert main(["generate", "--run-dir", str(run_dir), *flags]) == 0
    out, err = capsys.readouterr()
    assert len(out) == len("ROMEO:") + 500 + 1  # and the line's end
    assert err.splitlines() == [
        "notice: max_new_tokens=500 runs past the context (max_length=64): past it, each 16 "
        "tokens are generated anew from the last 48"
    ]
