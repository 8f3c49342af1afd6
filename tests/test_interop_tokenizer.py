"""A Hugging Face checkpoint's own tokenizer (``data.hf_tokenizer``) and ``flaxformer-lite generate
--hf_dir``, against ``transformers``: tiny random GPT-2, Llama and Marian checkpoints with
tokenizers trained in the test (``tests/hf_checkpoints.py``). Ids are compared with
``AutoTokenizer`` / ``MarianTokenizer``, and generated ids with ``model.generate(do_sample=False)``.
"""

import io
import json
import shutil

import hf_checkpoints
import numpy as np
import pytest

from flaxformer_lite.attention_maps import token_labels
from flaxformer_lite.cli import main
from flaxformer_lite.data.hf_tokenizer import HfTokenizer, load_hf_tokenizer
from flaxformer_lite.data.tokenizers import load_tokenizer
from flaxformer_lite.decode.text import continue_or_translate, printable
from flaxformer_lite.train.trained_run import load_hf_checkpoint

pytestmark = pytest.mark.fast_compile  # XLA's backend optimizations off: conftest.py

TEXTS = ["hello world, hello there!", "the lazy fox", "zebra: unseen ÷ text", "  two  spaces", "a"]
PROMPTS = ["hello world", "the quick brown", "all that"]


@pytest.fixture(scope="module")
def gpt2(hf, tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt2")
    return hf_checkpoints.gpt2_dir(hf.transformers, hf.torch, path), path


@pytest.fixture(scope="module")
def llama(hf, tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    return hf_checkpoints.llama_dir(hf.transformers, hf.torch, path), path


@pytest.fixture(scope="module")
def marian(hf, tmp_path_factory):
    sentencepiece = pytest.importorskip("sentencepiece")
    path = tmp_path_factory.mktemp("marian")
    return hf_checkpoints.marian_dir(hf.transformers, hf.torch, sentencepiece, path), path


def check_like_auto_tokenizer(hf, path, *, add_bos, eos_appended=False):
    """Our ids (with bos / eos where HF adds them) and decoded text equal AutoTokenizer's."""
    reference = hf.transformers.AutoTokenizer.from_pretrained(path)
    ours = load_hf_tokenizer(path)
    assert ours.add_bos == add_bos
    assert (ours.eos_id, ours.unk_id) == (reference.eos_token_id, reference.unk_token_id)
    for text in TEXTS:
        ids = [ours.sos_id] * add_bos + ours.encode(text) + [ours.eos_id] * eos_appended
        assert ids == reference(text).input_ids, text
        expected = reference.decode(ids, skip_special_tokens=True)
        assert ours.decode(ids) == expected
        assert ours.decode(np.array([*ids, ours.eos_id, ours.pad_id])) == expected
    return ours


def test_gpt2_tokenizer_has_the_checkpoint_ids(hf, gpt2):
    ours = check_like_auto_tokenizer(hf, gpt2[1], add_bos=False)
    eot = ours.token_id(hf_checkpoints.EOT)
    # No pad token: the end-of-text token fills in; bos = eos = unk = <|endoftext|>.
    assert (ours.sos_id, ours.eos_id, ours.pad_id, ours.unk_id) == (eot, eot, eot, eot)
    assert ours.vocab_size == gpt2[0].config.vocab_size


def test_llama_tokenizer_starts_with_bos(hf, llama):
    ours = check_like_auto_tokenizer(hf, llama[1], add_bos=True)
    assert (ours.sos_id, ours.eos_id, ours.unk_id, ours.pad_id) == (1, 2, 0, 2)
    # The tokenizer file alone, as PreTrainedTokenizerFast reads it.
    tokenizer_file = str(llama[1] / "tokenizer.json")
    file_only = hf.transformers.PreTrainedTokenizerFast(tokenizer_file=tokenizer_file)
    for text in TEXTS:
        assert [1, *ours.encode(text)] == file_only(text).input_ids


def test_marian_tokenizer_matches_marian_tokenizer(hf, marian, tmp_path):
    model, path = marian
    check_like_auto_tokenizer(hf, path, add_bos=False, eos_appended=True)
    auto = hf.transformers.AutoTokenizer.from_pretrained(path)
    assert type(auto) is hf.transformers.MarianTokenizer
    ours = load_hf_tokenizer(path)
    vocab = json.loads((path / "vocab.json").read_text())
    assert ours.sos_id == ours.pad_id == vocab["<pad>"] == model.config.decoder_start_token_id
    assert ours.eos_id == vocab["</s>"] == 0
    # A multilingual model's target-language code: one token, before the pieces.
    shutil.copytree(path, tmp_path, dirs_exist_ok=True)
    (tmp_path / "vocab.json").write_text(json.dumps({**vocab, ">>fra<<": len(vocab)}))
    reference = hf.transformers.MarianTokenizer.from_pretrained(tmp_path)
    ids = load_hf_tokenizer(tmp_path).encode(">>fra<< the dog")
    assert ids[0] == len(vocab) and ids + [0] == reference(">>fra<< the dog").input_ids


@pytest.mark.parametrize("name", ["gpt2", "llama", "marian"])
def test_saved_tokenizer_reads_back_alike(name, request, tmp_path):
    path = request.getfixturevalue(name)[1]
    ours = load_hf_tokenizer(path)
    ours.save(tmp_path)
    again = load_tokenizer(tmp_path)
    assert isinstance(again, HfTokenizer)
    assert (again.specials, again.add_bos, again.vocab_size) == (
        ours.specials,
        ours.add_bos,
        ours.vocab_size,
    )
    for text in TEXTS:
        assert again.encode(text) == ours.encode(text)
        assert again.decode(ours.encode(text)) == ours.decode(ours.encode(text))


def test_missing_or_bad_tokenizer_files_are_named(gpt2, tmp_path):
    with pytest.raises(FileNotFoundError, match="no such Hugging Face checkpoint directory"):
        load_hf_tokenizer(tmp_path / "nowhere")
    shutil.copy(gpt2[1] / "config.json", tmp_path / "config.json")
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json, or source\.spm \+ target"):
        load_hf_tokenizer(tmp_path)
    shutil.copy(gpt2[1] / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<nope>"}))
    with pytest.raises(ValueError, match=r"tokenizer_config\.json: bos_token '<nope>' is not"):
        load_hf_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("{}")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ValueError, match="no end-of-sequence token"):
        load_hf_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer.json: not a valid Hugging Face tokenizer"):
        load_hf_tokenizer(tmp_path)


def hf_greedy(hf, model, input_ids, max_new_tokens, eos_id, pad_id):
    """HF ``generate(do_sample=False)``'s new tokens for one input, cut before its first eos."""
    torch = hf.torch
    with torch.no_grad():
        out = model.generate(
            torch.tensor([input_ids]),
            do_sample=False,
            num_beams=1,
            max_new_tokens=max_new_tokens,
            pad_token_id=pad_id,
        )
    new = out[0].tolist()
    new = new[1:] if model.config.is_encoder_decoder else new[len(input_ids) :]
    return new[: new.index(eos_id)] if eos_id in new else new


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_generate_continues_like_hf_greedy(name, request, hf):
    hf_model, path = request.getfixturevalue(name)
    model, tokenizer = load_hf_checkpoint(path)
    ours = continue_or_translate(
        model, tokenizer, PROMPTS, add_bos=tokenizer.add_bos, max_new_tokens=20
    )
    reference = hf.transformers.AutoTokenizer.from_pretrained(path)
    for prompt, new in zip(PROMPTS, ours, strict=True):
        expected = hf_greedy(
            hf, hf_model, reference(prompt).input_ids, 20, tokenizer.eos_id, tokenizer.pad_id
        )
        assert new == expected, prompt
        assert len(new) > 3


def test_translate_decodes_like_hf_greedy(hf, marian):
    hf_model, path = marian
    model, tokenizer = load_hf_checkpoint(path)
    ours = continue_or_translate(model, tokenizer, PROMPTS, max_new_tokens=20)
    reference = hf.transformers.MarianTokenizer.from_pretrained(path)
    for prompt, new in zip(PROMPTS, ours, strict=True):
        expected = hf_greedy(
            hf, hf_model, reference(prompt).input_ids, 20, tokenizer.eos_id, tokenizer.pad_id
        )
        assert new == expected, prompt
        assert len(new) > 3


def test_generate_command_on_hf_dirs(gpt2, marian, capsys, tmp_path):
    assert (
        main(
            [
                "generate",
                "--hf_dir",
                str(gpt2[1]),
                "--prompt",
                "hello world",
                "--max_new_tokens",
                "6",
            ]
        )
        == 0
    )
    model, tokenizer = load_hf_checkpoint(gpt2[1])
    [new] = continue_or_translate(
        model, tokenizer, ["hello world"], add_bos=False, max_new_tokens=6
    )
    # Printed as generate prints text: control characters escaped.
    assert capsys.readouterr().out == printable(f"hello world{tokenizer.decode(new)}") + "\n"
    argv = [
        "generate",
        "--hf_dir",
        str(marian[1]),
        "--prompt",
        "the dog",
        "--beam_size",
        "3",
        "--n_best",
        "2",
        "--max_new_tokens",
        "8",
    ]
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "the dog" and len(lines) == 3
    (tmp_path / "config.json").write_text((gpt2[1] / "config.json").read_text())
    assert main(["generate", "--hf_dir", str(tmp_path), "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert str(tmp_path) in err and "tokenizer.json" in err and "source.spm" in err
    assert main(["generate", "--hf_dir", str(gpt2[1]), "--step", "3", "--prompt", "x"]) == 2
    argv = ["generate", "--hf_dir", str(gpt2[1]), "--prompt", "x", "--max_new_tokens", "0"]
    assert main(argv) == 2 and "--max-new-tokens must be positive" in capsys.readouterr().err


def test_generate_names_an_encoder_only_checkpoint(hf, tmp_path, capsys):
    config = hf.transformers.BertConfig(
        vocab_size=50,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
    )
    config.save_pretrained(tmp_path)  # no tokenizer either: the model kind is named first
    assert main(["generate", "--hf_dir", str(tmp_path), "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert str(tmp_path) in err and "encoder-only model" in err


def test_attention_labels_use_the_checkpoint_special_ids(gpt2):
    tokenizer = load_hf_tokenizer(gpt2[1])
    eot = tokenizer.eos_id
    ids = [eot, 1, 2, 3, *tokenizer.encode("hello")]
    labels = token_labels(tokenizer, ids)
    assert labels[0] == "<eos>"  # GPT-2's <|endoftext|> is bos, eos and pad at once
    assert labels[1:4] == [tokenizer.decode([i]) for i in (1, 2, 3)]  # regular tokens here
    assert "".join(labels[4:]) == "hello"


GERMAN = [
    "der schnelle braune fuchs springt",
    "hallo welt, hallo da!",
    "taten sagen mehr als worte",
    "der fruehe vogel faengt den wurm",
    "besser spaet als nie, sagen sie",
] * 6


def test_marian_sides_have_their_own_sentencepiece_models(hf, tmp_path):
    """A language pair with separate ``source.spm`` and ``target.spm``: sources are split by the
    one, targets (``encode_target``) and decoding by the other, as ``MarianTokenizer`` does; the
    files need not name ``<unk>``."""
    sentencepiece = pytest.importorskip("sentencepiece")
    models = []
    for corpus in (hf_checkpoints.CORPUS, GERMAN):
        buffer = io.BytesIO()
        sentencepiece.SentencePieceTrainer.train(
            sentence_iterator=iter(corpus),
            model_writer=buffer,
            vocab_size=60,
            hard_vocab_limit=False,
            minloglevel=2,
        )
        models.append(buffer.getvalue())
    pieces = []
    for model in models:
        sp = sentencepiece.SentencePieceProcessor(model_proto=model)
        for i in range(sp.get_piece_size()):
            piece = sp.id_to_piece(i)
            if piece not in ("<unk>", "<s>", "</s>", *pieces):
                pieces.append(piece)
    vocab = ["</s>", "<unk>", *pieces, "<pad>"]
    files = tmp_path / "files"
    files.mkdir()
    (files / "s.model").write_bytes(models[0])
    (files / "t.model").write_bytes(models[1])
    (files / "v.json").write_text(json.dumps({p: i for i, p in enumerate(vocab)}))
    reference = hf.transformers.MarianTokenizer(
        source_spm=str(files / "s.model"),
        target_spm=str(files / "t.model"),
        vocab=str(files / "v.json"),
    )
    path = tmp_path / "checkpoint"
    reference.save_pretrained(path)
    for name in ("tokenizer_config.json", "special_tokens_map.json"):  # no unk_token named
        if (path / name).is_file():
            values = json.loads((path / name).read_text())
            values.pop("unk_token", None)
            (path / name).write_text(json.dumps(values))
    (path / "config.json").write_text(json.dumps({"eos_token_id": 0}))
    ours = load_hf_tokenizer(path)
    assert ours.unk_id == 1
    for text in GERMAN[:5]:
        target = reference(text_target=text, add_special_tokens=False)["input_ids"]
        assert ours.encode_target(text) == target
        assert ours.decode(target) == reference.decode(target, skip_special_tokens=True)
    for text in TEXTS:
        assert ours.encode(text) + [0] == reference(text).input_ids
    assert ours.encode_target(GERMAN[3]) != ours.encode(GERMAN[3])  # the two models differ here
    # Ids past the tokenizer (rows a checkpoint pads its embedding table with) name no token.
    ids = ours.encode_target(GERMAN[0])
    assert ours.decode([*ids, len(vocab), len(vocab) + 5]) == ours.decode(ids)
