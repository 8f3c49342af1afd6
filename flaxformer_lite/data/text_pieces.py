"""Long texts cut into pieces before byte-level BPE sees them, without dropping any text.

BPE's cost grows with a text's length: its memory when encoding, and, fitting on a text without
spaces (one pre-tokenized word), its time quadratically. A prepared store tokenizes whole
documents on purpose (LM windows use every token), so the cost is bounded by the pieces' size.
"""

from __future__ import annotations

BPE_PIECE_CHARS = 4096


def text_pieces(text: str, max_chars: int = 0) -> list[str]:
    """``text`` cut into pieces of at most ``max_chars`` characters (default
    :data:`BPE_PIECE_CHARS`). Each cut is just before a space that follows a non-space, where
    byte-level BPE's pre-tokenizer splits anyway: the pieces' ids are the whole text's. Only a
    run of ``max_chars`` characters without such a space is cut inside it."""
    max_chars = max_chars or BPE_PIECE_CHARS
    pieces, start = [], 0
    while len(text) - start > max_chars:
        end = cut = start + max_chars
        while (cut := text.rfind(" ", start + 1, cut)) > start and text[cut - 1].isspace():
            pass
        cut = cut if cut > start else end
        pieces.append(text[start:cut])
        start = cut
    pieces.append(text[start:])
    return pieces


class PieceCounter:
    """:func:`text_pieces` that counts the texts it had to cut, and those it cut inside a run
    without spaces (the only cuts that change what BPE sees: a piece after a cut at a space
    starts with that space)."""

    long_texts = 0
    cut_inside_words = 0

    def __call__(self, text: str) -> list[str]:
        pieces = text_pieces(text)
        self.long_texts += len(pieces) > 1
        self.cut_inside_words += any(not piece.startswith(" ") for piece in pieces[1:])
        return pieces
