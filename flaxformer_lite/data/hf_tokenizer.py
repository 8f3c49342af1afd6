"""The tokenizer of a Hugging Face checkpoint directory, with the checkpoint's own ids.

    tokenizer = load_hf_tokenizer("path/to/checkpoint")   # tokenizer.json, or Marian's files
    ids = tokenizer.encode("Hello")                        # no specials, the model's ids
    prompt = [tokenizer.sos_id, *ids] if tokenizer.add_bos else ids

Unlike our own tokenizers (fixed layout ``0 <pad> 1 <sos> 2 <eos> 3 <unk>``), the ids are those the
checkpoint's embedding rows are indexed by; nothing is remapped. Two layouts are read:

* ``tokenizer.json`` (Hugging Face ``tokenizers``; GPT-2, Llama and most recent checkpoints);
* Marian's ``source.spm`` + ``target.spm`` + ``vocab.json`` (as ``transformers.MarianTokenizer``):
  source text -> SentencePiece pieces of ``source.spm`` (target text, :meth:`encode_target`: of
  ``target.spm``) -> ids of ``vocab.json`` (unknown pieces -> ``<unk>``); a leading language code
  such as ``>>fra<<`` is one token; decoding joins pieces with ``target.spm``. Moses punctuation
  normalization (applied by ``MarianTokenizer`` only when ``sacremoses`` is installed) is not.

Special ids, each checked to be in the vocabulary:

* ``eos_id``: ``eos_token_id`` of ``generation_config.json`` or ``config.json`` (the first of a
  list), else ``eos_token`` of ``tokenizer_config.json`` / ``special_tokens_map.json``;
* ``bos``: the tokenizer files' ``bos_token``, else ``bos_token_id`` of the configs;
* ``sos_id`` (what a decoder's input starts with): ``decoder_start_token_id`` of the configs
  (encoder-decoders; Marian's is its pad), else ``bos``, else ``eos_id``;
* ``pad_id``: the tokenizer files' ``pad_token``, else ``pad_token_id``, else ``eos_id`` (GPT-2
  has no pad token; batches mark padding by weights and masks, so ``pad_id`` is only a filler);
* ``unk_id``: the tokenizer files' ``unk_token`` (Marian: else ``<unk>``), or None.

``add_bos``: whether the checkpoint's tokenizer starts an input with ``bos``:
``add_bos_token`` of ``tokenizer_config.json`` when given, else what ``tokenizer.json``'s
post-processor does (Llama: yes; GPT-2: no); never for Marian. ``decode`` skips the special ids
(and ``tokenizer.json``'s other special tokens).

``save(directory)`` writes the tokenizer files and ``special_ids.json`` (the resolved ids): a run
trained from a checkpoint keeps its tokenizer, and :func:`~flaxformer_lite.data.tokenizers.
load_tokenizer` reads it back. Nothing is downloaded, pickled or executed.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from flaxformer_lite.data.tokenizer_base import Tokenizer, read_json_object

JSON_FILE = "tokenizer.json"
MARIAN_FILES = ("source.spm", "target.spm", "vocab.json")
SPECIAL_IDS_FILE = "special_ids.json"
_TOKEN_FILES = ("tokenizer_config.json", "special_tokens_map.json")
_MODEL_FILES = ("generation_config.json", "config.json")
_SPIECE_UNDERLINE = "\u2581"


class HfTokenizer(Tokenizer):
    """A checkpoint's tokenizer: ``tokenizer.json`` or Marian's SentencePiece files.

    Attributes:
      pad_id, sos_id, eos_id, unk_id: the special ids (see the module docstring; ``unk_id`` may
        be None).
      add_bos: whether prompts start with ``sos_id`` (the checkpoint tokenizer's convention).
    """

    name = "hf"

    def __init__(self, files: dict[str, bytes], specials: dict[str, int | None], add_bos: bool):
        """Builds the tokenizer from the contents of its files (``tokenizer.json``, or the three
        Marian files) and the resolved ``specials`` (``pad``, ``sos``, ``eos``, ``unk``,
        ``bos``)."""
        self._files_content = dict(files)
        if JSON_FILE in files:
            import tokenizers

            try:
                self._json = tokenizers.Tokenizer.from_str(files[JSON_FILE].decode("utf-8"))
            # The Rust bindings raise a bare Exception for any malformed file.
            except Exception as e:
                raise ValueError(f"{JSON_FILE}: not a valid Hugging Face tokenizer ({e})") from None
            self._vocab_size = self._json.get_vocab_size(with_added_tokens=True)
        else:
            import sentencepiece

            self._json = None
            self._source, self._target = (
                _sentencepiece(files, side, sentencepiece) for side in ("source.spm", "target.spm")
            )
            try:
                self._vocab = json.loads(files["vocab.json"].decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise ValueError(f"vocab.json: not valid UTF-8 JSON ({e})") from None
            if not isinstance(self._vocab, dict) or not all(
                isinstance(i, int) and i >= 0 for i in self._vocab.values()
            ):
                raise ValueError("vocab.json: expected an object of token -> id >= 0")
            self._pieces = {i: piece for piece, i in self._vocab.items()}
            self._vocab_size = max(self._vocab.values(), default=-1) + 1
        for name, value in specials.items():
            if value is not None and not 0 <= value < self._vocab_size:
                raise ValueError(
                    f"{name} id {value} is outside the vocabulary [0, {self._vocab_size})"
                )
        self.specials = dict(specials)
        self.pad_id, self.sos_id = specials["pad"], specials["sos"]
        self.eos_id, self.unk_id = specials["eos"], specials["unk"]
        self.add_bos = bool(add_bos)
        self._special_ids = {i for i in specials.values() if i is not None}

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def token_id(self, token: str) -> int | None:
        """The id of the vocabulary entry ``token`` (e.g. ``"</s>"``), or None."""
        if self._json is not None:
            return self._json.token_to_id(token)
        return self._vocab.get(token)

    def _post_processor_adds(self, bos: int | None) -> bool:
        """Whether ``tokenizer.json``'s post-processor puts ``bos`` before a text."""
        if self._json is None or bos is None:
            return False
        plain = self._json.encode("a", add_special_tokens=False).ids
        with_specials = self._json.encode("a", add_special_tokens=True).ids
        return with_specials[: len(plain) + 1] == [bos, *plain]

    def encode(self, text: str) -> list[int]:
        """The checkpoint's ids of ``text`` ``[T]``, without special tokens (Marian: split by
        ``source.spm``)."""
        if self._json is not None:
            return self._json.encode(text, add_special_tokens=False).ids
        return self._marian_ids(text, self._source)

    def encode_target(self, text: str) -> list[int]:
        """As :meth:`encode`, for a target text: Marian splits it by ``target.spm``."""
        if self._json is not None:
            return self.encode(text)
        return self._marian_ids(text, self._target)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """:meth:`encode` of each of ``texts``; ``tokenizer.json`` encodes them on all cores."""
        if self._json is not None:
            encode = getattr(self._json, "encode_batch_fast", self._json.encode_batch)  # 0.20+
            encodings = encode(list(texts), add_special_tokens=False)
            return [encoding.ids for encoding in encodings]
        return [self._marian_ids(text, self._source) for text in texts]

    def encode_target_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """:meth:`encode_target` of each of ``texts``."""
        if self._json is not None:
            return self.encode_batch(texts)
        return [self._marian_ids(text, self._target) for text in texts]

    def _marian_ids(self, text: str, model) -> list[int]:
        code = []
        if text.startswith(">>") and (end := text.find("<<")) != -1:  # a language code
            code, text = [text[: end + 2]], text[end + 2 :]
        pieces = code + model.encode(text, out_type=str)
        missing = [p for p in pieces if p not in self._vocab]
        if missing and self.unk_id is None:
            raise ValueError(f"vocab.json has no {missing[0]!r} and no <unk> token to stand for it")
        return [self._vocab.get(piece, self.unk_id) for piece in pieces]

    def decode(self, ids) -> str:
        """Text of ``ids``, without the special ids; ids at or beyond ``vocab_size`` (the rows a
        checkpoint pads its embedding table with, which name no token) are dropped too."""
        ids = np.asarray(ids, dtype=np.int64)
        return super().decode(ids[ids < self.vocab_size] if ids.ndim == 1 else ids)

    def is_special(self, token_id: int) -> bool:
        """Whether ``decode`` drops ``token_id``: one of this checkpoint's special ids."""
        return token_id in self._special_ids

    def _decode_regular(self, ids: list[int]) -> str:
        if self._json is not None:
            return self._json.decode(ids, skip_special_tokens=True)
        # As MarianTokenizer: pieces joined by the target model, then "▁" -> " " and stripped.
        pieces = [self._pieces[i] for i in ids if i in self._pieces]
        text = self._target.decode_pieces(pieces)
        return text.replace(_SPIECE_UNDERLINE, " ").strip()

    def _files(self) -> dict[str, bytes]:
        state = {"specials": self.specials, "add_bos": self.add_bos}
        return {**self._files_content, SPECIAL_IDS_FILE: json.dumps(state, indent=1).encode()}

    @classmethod
    def _load_files(cls, directory: Path) -> HfTokenizer:
        path = directory / SPECIAL_IDS_FILE
        state = read_json_object(path)
        names = (JSON_FILE,) if (directory / JSON_FILE).is_file() else MARIAN_FILES
        try:
            files = {name: _read_bytes(directory / name) for name in names}
            return cls(files, state["specials"], state["add_bos"])
        except (KeyError, TypeError) as e:
            raise ValueError(f"{path}: not a saved Hugging Face tokenizer ({e!r})") from None


def load_hf_tokenizer(directory: Path | str) -> HfTokenizer:
    """The tokenizer of the Hugging Face checkpoint directory ``directory``.

    Raises:
      FileNotFoundError: ``directory`` is missing, or holds neither ``tokenizer.json`` nor
        ``source.spm`` + ``target.spm`` + ``vocab.json`` (the message names both).
      ValueError: an unreadable file (named), a special token that is not in the vocabulary, no
        end-of-sequence token, or a Marian tokenizer with separate vocabularies.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"{directory}: no such Hugging Face checkpoint directory")
    token_files = {
        n: read_json_object(directory / n) for n in _TOKEN_FILES if (directory / n).is_file()
    }
    model_files = {
        n: read_json_object(directory / n) for n in _MODEL_FILES if (directory / n).is_file()
    }
    if (directory / JSON_FILE).is_file():
        files = {JSON_FILE: _read_bytes(directory / JSON_FILE)}
    elif all((directory / name).is_file() for name in MARIAN_FILES):
        if token_files.get("tokenizer_config.json", {}).get("separate_vocabs"):
            raise ValueError(
                f"{directory / 'tokenizer_config.json'}: Marian tokenizers with "
                "separate_vocabs are not supported"
            )
        files = {name: _read_bytes(directory / name) for name in MARIAN_FILES}
    else:
        raise FileNotFoundError(
            f"{directory}: no tokenizer found; looked for {JSON_FILE}, or "
            f"{' + '.join(MARIAN_FILES)} (Marian)"
        )
    # A tokenizer without specials, only to look their tokens up.
    plain = HfTokenizer(files, dict.fromkeys(("pad", "sos", "eos", "unk", "bos")), False)

    def token_id(name: str) -> int | None:
        for file, values in token_files.items():
            token = values.get(f"{name}_token")
            token = token.get("content") if isinstance(token, dict) else token
            if isinstance(token, str):
                found = plain.token_id(token)
                if found is None:
                    raise ValueError(
                        f"{directory / file}: {name}_token {token!r} is not in the vocabulary"
                    )
                return found
        return None

    def config_id(key: str) -> int | None:
        for values in model_files.values():
            value = values.get(key)
            value = value[0] if isinstance(value, list) and value else value
            if isinstance(value, int) and not isinstance(value, bool):
                return value
        return None

    eos = _first(config_id("eos_token_id"), token_id("eos"))
    if eos is None:
        looked = ", ".join((*_MODEL_FILES, *_TOKEN_FILES))
        raise ValueError(f"{directory}: no end-of-sequence token in {looked}")
    bos = _first(token_id("bos"), config_id("bos_token_id"))
    specials = {
        "pad": _first(token_id("pad"), config_id("pad_token_id"), eos),
        "sos": _first(config_id("decoder_start_token_id"), bos, eos),
        "eos": eos,
        # MarianTokenizer's default unk_token is "<unk>" (the files need not name it).
        "unk": _first(token_id("unk"), None if JSON_FILE in files else plain.token_id("<unk>")),
        "bos": bos,
    }
    add_bos = token_files.get("tokenizer_config.json", {}).get("add_bos_token")
    if not isinstance(add_bos, bool):
        add_bos = plain._post_processor_adds(bos)
    return HfTokenizer(files, specials, add_bos and bos is not None)


def _sentencepiece(files: dict[str, bytes], name: str, sentencepiece):
    try:
        return sentencepiece.SentencePieceProcessor(model_proto=files[name])
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"{name}: not a SentencePiece model ({e})") from None


def _first(*values: int | None) -> int | None:
    return next((v for v in values if v is not None), None)


def _read_bytes(path: Path) -> bytes:
    if not path.is_file():
        raise FileNotFoundError(f"{path}: file not found")
    return path.read_bytes()
