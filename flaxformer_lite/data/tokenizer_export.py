"""A run's tokenizer as the files ``transformers.AutoTokenizer`` loads (``PreTrainedTokenizerFast``
over one ``tokenizer.json``), with our ids, for every tokenizer:

* byte: byte-level BPE without merges: the 256 bytes, as GPT-2's printable byte characters, at
  ids 4..259 (``ByteLevel`` pre-tokenizer and decoder, which maps invalid UTF-8 to U+FFFD as
  ours does);
* char: ``WordLevel`` over the characters, each character its own pre-token (``Split`` on
  ``[\\s\\S]``), joined back without separators (``Fuse``);
* word: ``WordLevel`` over the words, pre-tokenized as ours (whitespace removed, then
  ``\\w+|[^\\w\\s]`` isolated; ``Lowercase`` first if the vocabulary is lowercased), joined back
  with single spaces (no decoder);
* bpe: our ``tokenizer.json`` itself;
* sentencepiece: the ``.model`` rebuilt in ``tokenizers`` as ``transformers``' own conversion
  does (``SpmConverter.build_tokenizer_from_spm_proto``): its normalizer (precompiled character
  map, extra spaces removed, whitespace as ``▁``, the dummy prefix), a ``Unigram`` (or BPE
  with merges ranked by piece score) over the pieces in our id order, byte fallback;
* hf (a run fine-tuned from a Hugging Face checkpoint): the checkpoint's files.

The four specials (``<pad>``, ``<sos>``, ``<eos>``, ``<unk>`` at 0..3; a SentencePiece model's
own names for those it has) are special tokens, and a post-processor adds what our rows have:
``<sos> text`` for a decoder LM (as ``generate`` prompts), ``<sos> text <eos>`` for an encoder,
``text <eos>`` for an encoder-decoder's source. ``tokenizer_config.json`` names the specials
(``mask_token`` is ``<unk>``, the id our masked-LM rows mask with) and the inputs the model
takes. Text holding a special token's name (``"<eos>"``) is that token in ``transformers``,
characters in ours.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from flaxformer_lite.data.features import MASK_ID
from flaxformer_lite.data.tasks import Task
from flaxformer_lite.data.tokenizers import (
    EOS_ID,
    NUM_SPECIAL,
    SOS_ID,
    SPECIAL_TOKENS,
    Tokenizer,
)

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
SPECIAL_MAP_FILE = "special_tokens_map.json"
_NAMES = ("pad", "bos", "eos", "unk")  # HF's names of our four specials, in id order


def hf_tokenizer_files(tokenizer: Tokenizer, *, task: Task, max_length: int) -> dict[str, bytes]:
    """File name -> contents of ``tokenizer``'s Hugging Face files, for a model of ``task``.

    Args:
      tokenizer: a run's tokenizer (any ``load_tokenizer`` reads).
      task: ``lm``, ``mlm``, ``classify`` or ``seq2seq``: what the post-processor adds.
      max_length: the model's longest input (``model_max_length``).

    Raises:
      ValueError: a tokenizer these files cannot express (named).
    """
    if tokenizer.name == "hf":
        return _checkpoint_files(tokenizer, task=task, max_length=max_length)
    hf = _hf_tokenizer(tokenizer)
    names = [hf.id_to_token(i) for i in range(NUM_SPECIAL)]
    hf.post_processor = _post_processor(task, (names[SOS_ID], SOS_ID), (names[EOS_ID], EOS_ID))
    specials = dict(zip(_NAMES, names, strict=True))
    return {
        TOKENIZER_FILE: hf.to_str(pretty=True).encode(),
        **_config_files(specials, task=task, max_length=max_length, mask=names[MASK_ID]),
    }


def _hf_tokenizer(tokenizer: Tokenizer):
    """Our tokenizer as a ``tokenizers.Tokenizer`` with our ids, without a post-processor."""
    import tokenizers
    from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers

    if tokenizer.name == "bpe":
        hf = tokenizers.Tokenizer.from_str(tokenizer.hf_tokenizer.to_str())
    elif tokenizer.name == "byte":
        char_of = _bytes_to_unicode()
        vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
        vocab |= {char_of[b]: NUM_SPECIAL + b for b in range(256)}
        hf = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        hf.decoder = decoders.ByteLevel()
    elif tokenizer.name in ("char", "word"):
        vocab = {t: i for i, t in enumerate(tokenizer.itos)}
        hf = tokenizers.Tokenizer(models.WordLevel(vocab=vocab, unk_token=SPECIAL_TOKENS[3]))
        if tokenizer.name == "char":
            hf.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
            hf.decoder = decoders.Fuse()
        else:  # no decoder: tokens are joined with spaces, as ours
            hf.pre_tokenizer = pre_tokenizers.Sequence(
                [
                    pre_tokenizers.Split(Regex(r"\s+"), behavior="removed"),
                    pre_tokenizers.Split(Regex(r"\w+|[^\w\s]"), behavior="isolated"),
                ]
            )
            if tokenizer.lowercase:
                hf.normalizer = normalizers.Lowercase()
    elif tokenizer.name == "sentencepiece":
        hf = _sentencepiece(tokenizer)
    else:
        raise ValueError(f"a {tokenizer.name!r} tokenizer has no Hugging Face form here")
    names = [hf.id_to_token(i) for i in range(NUM_SPECIAL)]
    hf.add_special_tokens(
        [tokenizers.AddedToken(name, special=True, normalized=False) for name in names]
    )
    found = [hf.token_to_id(name) for name in names]
    if found != list(range(NUM_SPECIAL)) or hf.get_vocab_size() != tokenizer.vocab_size:
        raise AssertionError(f"the {tokenizer.name} conversion moved the specials: {found}")
    return hf


def _sentencepiece(tokenizer: Tokenizer):
    """The SentencePiece model in ``tokenizers``, its pieces in our id order (as
    ``transformers``' ``SpmConverter.build_tokenizer_from_spm_proto`` with ``legacy=True``)."""
    import re

    import tokenizers
    from sentencepiece import sentencepiece_model_pb2
    from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers

    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(tokenizer.sp.serialized_model_proto())
    sp = tokenizer.sp
    special_model_ids = [sp.pad_id(), sp.bos_id(), sp.eos_id(), sp.unk_id()]
    # Our id -> (piece, score, type): the specials the model has keep their pieces, the others
    # get ours; regular ids follow the model's order (SentencePieceTokenizer._to_model).
    pieces = [
        (proto.pieces[m].piece, 0.0, proto.pieces[m].type) if m >= 0 else (name, 0.0, 3)
        for m, name in zip(special_model_ids, SPECIAL_TOKENS, strict=True)
    ]
    pieces += [(p.piece, p.score, p.type) for p in (proto.pieces[m] for m in tokenizer._to_model)]
    if len({piece for piece, _, _ in pieces}) != len(pieces):
        raise ValueError(
            f"the SentencePiece model has a piece named like one of {list(SPECIAL_TOKENS)}, "
            "which its own specials do not use"
        )
    spec, byte_fallback = proto.normalizer_spec, proto.trainer_spec.byte_fallback
    user_defined = [piece for piece, _, piece_type in pieces if piece_type == 4]
    if proto.trainer_spec.model_type == 1:  # unigram
        model = models.Unigram([(p, s) for p, s, _ in pieces], NUM_SPECIAL - 1, byte_fallback)
    elif proto.trainer_spec.model_type == 2:  # BPE: merges ranked by the pieces' scores
        vocab = {piece: i for i, (piece, _, _) in enumerate(pieces)}
        normal = {p: (s, i) for i, (p, s, piece_type) in enumerate(pieces) if piece_type == 1}
        ranked = sorted(
            (-score, i, token[:cut], token[cut:])
            for token, (score, i) in normal.items()
            for cut in range(1, len(token))
            if token[:cut] in normal and token[cut:] in normal
        )
        model = models.BPE(
            vocab=vocab,
            merges=[(left, right) for _, _, left, right in ranked],
            unk_token=pieces[NUM_SPECIAL - 1][0],
            fuse_unk=True,
            byte_fallback=byte_fallback,
            ignore_merges=bool(user_defined),
        )
    else:
        raise ValueError(
            f"SentencePiece model type {proto.trainer_spec.model_type} (only unigram and BPE "
            "models have a Hugging Face form)"
        )
    hf = tokenizers.Tokenizer(model)
    steps = []
    if spec.precompiled_charsmap:
        steps.append(normalizers.Precompiled(spec.precompiled_charsmap))
    if spec.remove_extra_whitespaces:  # spaces only, as SentencePiece
        steps += [
            normalizers.Replace(Regex(r"\A +| +\z"), ""),
            normalizers.Replace(Regex(" {2,}"), " "),
        ]
    if spec.escape_whitespaces:
        steps.append(normalizers.Replace(" ", "▁"))
    if spec.add_dummy_prefix:
        # Metaspace skips the dummy prefix of a text already starting with "▁"; SentencePiece not.
        steps.append(normalizers.Replace(Regex(r"\A▁"), "▁▁"))
    hf.normalizer = normalizers.Sequence(steps)
    splits = []
    if spec.add_dummy_prefix:
        splits.append(
            pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=False)
        )
    if user_defined:  # SentencePiece emits user-defined pieces whole
        pattern = "|".join(re.escape(p) for p in sorted(user_defined, key=len, reverse=True))
        splits.append(pre_tokenizers.Split(Regex(pattern), behavior="isolated"))
    if splits:
        hf.pre_tokenizer = pre_tokenizers.Sequence(splits)
    steps = [decoders.Replace("▁", " ")]
    if byte_fallback:
        steps.append(decoders.ByteFallback())
    if spec.add_dummy_prefix:
        steps += [decoders.Fuse(), decoders.Strip(content=" ", left=1)]
    elif byte_fallback:
        steps.append(decoders.Fuse())
    hf.decoder = decoders.Sequence(steps)
    return hf


def _checkpoint_files(tokenizer, *, task: Task, max_length: int) -> dict[str, bytes]:
    """A Hugging Face checkpoint's tokenizer (a run fine-tuned from it): its ``tokenizer.json``
    with our rows' ``<sos>`` added before a decoder LM's text where it adds none, or Marian's
    files as ``MarianTokenizer`` reads them."""
    from flaxformer_lite.data.hf_tokenizer import JSON_FILE, MARIAN_FILES

    files = tokenizer._files_content
    specials = {name: tokenizer.specials.get(name) for name in _NAMES}
    if JSON_FILE not in files:
        names = {name: tokenizer._pieces.get(i) for name, i in specials.items() if i is not None}
        config = _config_files(names, task=task, max_length=max_length, mask=None)
        tokenizer_config = json.loads(config[CONFIG_FILE]) | {"tokenizer_class": "MarianTokenizer"}
        return {
            **{name: files[name] for name in MARIAN_FILES},
            CONFIG_FILE: _json_bytes(tokenizer_config),
            SPECIAL_MAP_FILE: config[SPECIAL_MAP_FILE],
        }
    import tokenizers
    from tokenizers import processors

    hf = tokenizers.Tokenizer.from_str(files[JSON_FILE].decode("utf-8"))
    names = {name: hf.id_to_token(i) for name, i in specials.items() if i is not None}
    sos = tokenizer.sos_id
    # A decoder LM's runs train on <sos> + text (as generate prompts): add it where HF's does not.
    if task.continues and not tokenizer.add_bos:
        eos = (hf.id_to_token(tokenizer.eos_id), tokenizer.eos_id)
        added = _post_processor(task, (hf.id_to_token(sos), sos), eos)
        before = hf.post_processor
        hf.post_processor = processors.Sequence([before, added]) if before else added
        names["bos"] = hf.id_to_token(sos)
    return {
        JSON_FILE: hf.to_str(pretty=True).encode(),
        **_config_files(names, task=task, max_length=max_length, mask=None),
    }


def _post_processor(task: Task, sos: tuple[str, int], eos: tuple[str, int]):
    """What our rows add around a text (:meth:`Task.template`), ``sos`` and ``eos`` each
    ``(token, id)``: ``<sos> $A`` (lm), ``<sos> $A <eos>`` (mlm, classify), ``$A <eos>``
    (seq2seq sources)."""
    from tokenizers import processors

    around = task.template(sos, eos)
    return processors.TemplateProcessing(
        single=" ".join(part if part == "$A" else part[0] for part in around),
        special_tokens=list(dict.fromkeys(part for part in around if part != "$A")),
    )


def _config_files(
    specials: Mapping[str, str | None], *, task: Task, max_length: int, mask: str | None
) -> dict[str, bytes]:
    """``tokenizer_config.json`` and ``special_tokens_map.json`` naming the special tokens."""
    tokens = {f"{name}_token": token for name, token in specials.items() if token is not None}
    if mask is not None and task.mask_token:
        tokens["mask_token"] = mask
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **tokens,
        "model_max_length": max_length,
        "model_input_names": list(task.hf_inputs),
        "clean_up_tokenization_spaces": False,  # decode as ours: "a ," stays "a ,"
    }
    return {CONFIG_FILE: _json_bytes(config), SPECIAL_MAP_FILE: _json_bytes(tokens)}


def _json_bytes(content) -> bytes:
    return (json.dumps(content, indent=2, ensure_ascii=False) + "\n").encode()


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable character for each byte, the alphabet of ``ByteLevel``."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    extra = iter(range(256, 512))
    return {b: chr(b if b in printable else next(extra)) for b in range(256)}
