"""Tiny Hugging Face checkpoint directories built inside the tests (no downloads): random GPT-2,
Llama and Marian models saved with ``save_pretrained``, next to tokenizers trained on
:data:`CORPUS` with ``tokenizers`` / ``sentencepiece`` and saved as ``transformers`` saves them.

Shared by the ``test_interop*.py`` files and ``test_init_from.py``, with the comparison and
config edits of the interop tests; the directories need ``transformers``, ``torch``,
``tokenizers`` (and ``sentencepiece`` for Marian).
"""

import io
import json

import numpy as np

TOL = 1e-4  # float32 logits against transformers', absolute
VOCAB = 128  # of the random tiny models of the interop tests

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "hello world, hello there!",
    "a stitch in time saves nine",
    "all that glitters is not gold",
    "the early bird catches the worm",
    "where there is smoke there is fire",
    "actions speak louder than words",
    "better late than never, they say",
] * 4
EOT = "<|endoftext|>"


def max_diff(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32))))


def edit_config(path, **changes) -> None:
    """Sets ``changes`` in the ``config.json`` of the checkpoint directory ``path``."""
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


def randomize(torch, model, seed=0):
    """Moves every parameter well away from its init (larger logits, fewer near-ties between
    the greedy choices of two implementations); float32, eval mode."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "embed_positions" not in name:  # Marian's fixed sinusoid tables stay
                p.add_(0.1 * torch.randn(p.shape, generator=generator))
    return model.float().eval()


def bpe_tokenizer(vocab_size=300):
    """A GPT-2-style byte-level BPE with ``<|endoftext|>`` (id 0) as its only special token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    return tok


def gpt2_dir(transformers, torch, path, *, n_positions=64):
    """A random 2-layer GPT-2 and its BPE tokenizer in ``path``; returns the HF model."""
    tok = bpe_tokenizer()
    eot = tok.token_to_id(EOT)
    transformers.GPT2TokenizerFast(
        tokenizer_object=tok, bos_token=EOT, eos_token=EOT, unk_token=EOT
    ).save_pretrained(path)
    config = transformers.GPT2Config(
        vocab_size=tok.get_vocab_size(),
        n_positions=n_positions,
        n_embd=32,
        n_layer=2,
        n_head=2,
        bos_token_id=eot,
        eos_token_id=eot,
    )
    torch.manual_seed(0)
    model = randomize(torch, transformers.GPT2LMHeadModel(config))
    model.save_pretrained(path)
    return model


def llama_dir(transformers, torch, path):
    """A random 2-layer Llama (GQA) and a Metaspace BPE tokenizer whose post-processor adds
    ``<s>`` (as Llama's does) in ``path``; returns the HF model."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(
        vocab_size=150, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    # Saved as Llama 3's are: AutoTokenizer then reads tokenizer.json as it is (v5's
    # LlamaTokenizer class would rebuild its normalizer and pre-tokenizer).
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    ).save_pretrained(path)
    config = transformers.LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    model = randomize(torch, transformers.LlamaForCausalLM(config))
    model.save_pretrained(path)
    return model


def marian_dir(transformers, torch, sentencepiece, path):
    """A random 2+2-layer Marian model and MarianTokenizer's files (``source.spm`` =
    ``target.spm``, a SentencePiece unigram model; ``vocab.json`` with OPUS-MT's layout: ``</s>``
    0, ``<unk>`` 1, the pieces, ``<pad>`` last) in ``path``; returns the HF model."""
    buffer = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS),
        model_writer=buffer,
        vocab_size=60,
        hard_vocab_limit=False,
        minloglevel=2,
    )
    spm_path = path / "spm.model"
    spm_path.write_bytes(buffer.getvalue())
    sp = sentencepiece.SentencePieceProcessor(model_proto=buffer.getvalue())
    pieces = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
    vocab = ["</s>", "<unk>", *(p for p in pieces if p not in ("<unk>", "<s>", "</s>")), "<pad>"]
    vocab_path = path / "vocab-src.json"
    vocab_path.write_text(json.dumps({p: i for i, p in enumerate(vocab)}))
    transformers.MarianTokenizer(
        source_spm=str(spm_path), target_spm=str(spm_path), vocab=str(vocab_path)
    ).save_pretrained(path)
    spm_path.unlink()
    vocab_path.unlink()
    pad = len(vocab) - 1
    config = transformers.MarianConfig(
        vocab_size=len(vocab),
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_position_embeddings=64,
        pad_token_id=pad,
        decoder_start_token_id=pad,
        eos_token_id=0,
        forced_eos_token_id=None,
    )
    torch.manual_seed(0)
    model = randomize(torch, transformers.MarianMTModel(config))
    model.save_pretrained(path)
    return model
