"""The SentencePiece tokenizer: a trained ``.model`` file behind the shared id layout of
:mod:`flaxformer_lite.data.tokenizer_base` (the ``sentencepiece`` library is imported when a run
asks for one)."""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from flaxformer_lite.data.tokenizer_base import (
    NUM_SPECIAL,
    Tokenizer,
    require_file,
)

SENTENCEPIECE_FILE = "sentencepiece.model"


class SentencePieceTokenizer(Tokenizer):
    """A trained SentencePiece ``.model`` file, with ids remapped to the shared layout.

    The model's own ``<pad>``, ``<s>``, ``</s>`` and ``<unk>`` pieces (whichever it has) map to
    0, 1, 2 and 3; its other pieces keep their order from id 4. Any model works, e.g. the default
    layout ``unk=0, bos=1, eos=2, pad=-1``; one trained with ``pad_id=0, bos_id=1, eos_id=2,
    unk_id=3`` maps onto itself. Round trips are exact only for text the model's normalizer
    leaves alone (by default NFKC, and runs of whitespace become one space).
    """

    name = "sentencepiece"

    @classmethod
    def made(cls, *, texts=None, vocab_size=None, path=None) -> SentencePieceTokenizer:
        if path is None:
            raise ValueError("tokenizer 'sentencepiece' needs path (a .model file)")
        return cls(path)

    def __init__(self, model_path: Path | str):
        """Loads ``model_path``; raises FileNotFoundError or ValueError naming it if unusable."""
        import sentencepiece  # Imported here: the other tokenizers work without it.

        path = require_file(Path(model_path))
        try:
            self.sp = sentencepiece.SentencePieceProcessor(model_file=str(path))
        except (RuntimeError, OSError) as e:
            raise ValueError(f"{path}: not a readable SentencePiece model ({e})") from None
        model_specials = [self.sp.pad_id(), self.sp.bos_id(), self.sp.eos_id(), self.sp.unk_id()]
        specials = {mid: ours for ours, mid in enumerate(model_specials) if mid >= 0}  # -1: absent
        # _to_model[i - NUM_SPECIAL] is the model id of our regular id i; _from_model inverts it.
        self._to_model = [mid for mid in range(self.sp.get_piece_size()) if mid not in specials]
        from_model = specials | {m: NUM_SPECIAL + i for i, m in enumerate(self._to_model)}
        self._from_model = np.array([from_model[m] for m in range(self.sp.get_piece_size())])

    @property
    def vocab_size(self) -> int:
        return NUM_SPECIAL + len(self._to_model)

    def encode(self, text: str) -> list[int]:
        return self._from_model[self.sp.encode(text)].tolist()

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        # SentencePiece encodes a list on all cores; one table lookup maps all the ids.
        model_ids = self.sp.encode(list(texts), num_threads=os.cpu_count() or 1)
        flat = np.fromiter(itertools.chain.from_iterable(model_ids), np.int64)
        ids = self._from_model[flat].tolist()
        ends = itertools.accumulate(map(len, model_ids))
        return [ids[end - len(m) : end] for m, end in zip(model_ids, ends, strict=True)]

    def _decode_regular(self, ids: list[int]) -> str:
        return self.sp.decode([self._to_model[i - NUM_SPECIAL] for i in ids])

    def _files(self) -> dict[str, bytes]:
        return {SENTENCEPIECE_FILE: self.sp.serialized_model_proto()}

    @classmethod
    def _load_files(cls, directory: Path) -> SentencePieceTokenizer:
        return cls(directory / SENTENCEPIECE_FILE)
