"""What every tokenizer shares: the special ids' layout, the :class:`Tokenizer` interface, the
name marker of a saved tokenizer, and the reading of its files. Each tokenizer is its own module
(:mod:`~flaxformer_lite.data.tokenizers` for byte, char, word and BPE,
:mod:`~flaxformer_lite.data.sentencepiece_tokenizer`, :mod:`~flaxformer_lite.data.hf_tokenizer`)
over this one, and :mod:`~flaxformer_lite.data.tokenizers` makes or loads any of them by name:
no module of a tokenizer imports the one that dispatches.
"""

from __future__ import annotations

import abc
import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import ClassVar

import numpy as np

SPECIAL_TOKENS = ("<pad>", "<sos>", "<eos>", "<unk>")
PAD_ID, SOS_ID, EOS_ID, UNK_ID = range(len(SPECIAL_TOKENS))
NUM_SPECIAL = len(SPECIAL_TOKENS)

# The marker of a saved tokenizer, ``{"kind": name}``: file and key keep the names runs were
# saved with, so those runs load.
NAME_FILE = "tokenizer_kind.json"


class Tokenizer(abc.ABC):
    """Common interface; subclasses implement encoding and their own files."""

    name: ClassVar[str]  # the data.tokenizer value that makes it
    pad_id: ClassVar[int] = PAD_ID
    sos_id: ClassVar[int] = SOS_ID
    eos_id: ClassVar[int] = EOS_ID
    unk_id: ClassVar[int] = UNK_ID
    # Whether every text has ids of its own (bytes, byte-level BPE): ``unk_id`` never appears.
    covers_all_text: ClassVar[bool] = False
    # Whether a decoder's input starts with ``sos_id``: a run's rows do; an imported Hugging Face
    # tokenizer says whether its checkpoint's do (``HfTokenizer``).
    add_bos: bool = True
    # Whether it is fitted on the data's texts (char, word, bpe), else given whole.
    fitted: ClassVar[bool] = False

    @classmethod
    def made(
        cls,
        *,
        texts: Iterable[str] | None = None,
        vocab_size: int | None = None,
        path: Path | str | None = None,
    ) -> Tokenizer:
        """The tokenizer ``data.tokenizer`` names, made as the settings say: fitted on ``texts``
        (up to ``vocab_size``) or read from ``path``, whichever this kind takes."""
        return cls()

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int:
        """Number of ids, specials included; every id is in ``[0, vocab_size)``."""

    @abc.abstractmethod
    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, without ``<sos>``/``<eos>``."""

    def encode_target(self, text: str) -> list[int]:
        """Token ids of a target text (a decoder's side of a seq2seq pair); the same as
        :meth:`encode` unless the two sides have their own models (Marian)."""
        return self.encode(text)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """:meth:`encode` of each text; tokenizers with a batched encoder use it (the same ids)."""
        return [self.encode(text) for text in texts]

    def encode_target_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """:meth:`encode_target` of each text, batched as :meth:`encode_batch`."""
        return self.encode_batch(texts)

    def decode(self, ids) -> str:
        """Text of ``ids`` (a list or int ``[T]`` array) without the ids :meth:`is_special` names.

        Raises:
          ValueError: if ``ids`` is not one-dimensional or holds an id outside the vocabulary.
        """
        ids = np.asarray(ids, dtype=np.int64)
        if ids.ndim != 1:
            raise ValueError(f"decode takes one sequence of ids [T], got shape {ids.shape}")
        bad = ids[(ids < 0) | (ids >= self.vocab_size)]
        if bad.size:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        return self._decode_regular([i for i in ids.tolist() if not self.is_special(i)])

    def same_as(self, other: Tokenizer) -> bool:
        """Whether ``other`` is this tokenizer: the same name and the same files."""
        return self.name == other.name and self._files() == other._files()

    def is_special(self, token_id: int) -> bool:
        """Whether ``decode`` drops ``token_id``: one of the four special ids."""
        return token_id < NUM_SPECIAL

    def files(self) -> dict[str, bytes]:
        """File name -> contents of what :meth:`save` writes, the name marker last."""
        marker = (json.dumps({"kind": self.name}) + "\n").encode()
        return {**self._files(), NAME_FILE: marker}

    def save(self, directory: Path) -> None:
        """Writes this tokenizer's files and the name marker into ``directory`` (created)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        # The marker goes last, so an interrupted save into a fresh directory is not loadable.
        for name, content in self.files().items():
            (directory / name).write_bytes(content)

    @abc.abstractmethod
    def _decode_regular(self, ids: list[int]) -> str:
        """Text of ids that are none of the special ids (:meth:`is_special` is False for each)."""

    def _files(self) -> dict[str, bytes]:
        """File name -> contents that ``save`` writes; byte tokenizers need none."""
        return {}

    @classmethod
    def _load_files(cls, directory: Path) -> Tokenizer:
        """Rebuilds the tokenizer from the files ``_files`` named."""
        return cls()


def require_file(path: Path) -> Path:
    if not path.is_file():
        raise FileNotFoundError(f"{path}: file not found")
    return path


def read_json_object(path: Path) -> dict:
    """The JSON object in ``path``; missing, empty, non-UTF-8 or non-object files raise."""
    try:
        data = json.loads(require_file(path).read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not valid UTF-8 JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data
