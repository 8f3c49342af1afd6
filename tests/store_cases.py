"""Small corpora and file snapshots shared by the store tests."""

import hashlib
import itertools
import random
from pathlib import Path

import numpy as np

WORDS = (
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "naïve",
    "café",
    "日本語",
    "🎉",
)
FITTED = ("char", "word", "bpe")


def make_lines(count, seed=0, words=8):
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, words))) for _ in range(count)]


def make_corpus(tmp_path):
    """Two text files (blank lines, a CRLF line, a repeated line): 120 documents, each but one
    with a character of its own. Returns the glob and the documents' texts."""
    lines = [f"{line} {chr(0x4E00 + i)}" for i, line in enumerate(make_lines(120))]
    lines[7] = lines[3]
    (tmp_path / "a.txt").write_text("\n\n".join(lines[:70]) + "\r\n", encoding="utf-8")
    (tmp_path / "b.txt").write_text("\n".join(lines[70:]), encoding="utf-8")
    return str(tmp_path / "*.txt"), [line.strip("\r") for line in lines]


def all_files(directory):
    return {p: p.stat().st_mtime_ns for p in sorted(Path(directory).rglob("*"))}


def check_documents(store, docs, fields=("text",)):
    """The store holds ``docs`` (tuples of field texts) in order, each field's ids as encoded."""
    documents, tokenizer = store.documents, store.tokenizer
    assert len(documents) == len(docs) == store.manifest["documents"]
    for f, name in enumerate(fields):
        encode = tokenizer.encode_target if name == "target" else tokenizer.encode
        ids = [encode(doc[f]) for doc in docs]
        assert [documents.document(name, i).tolist() for i in range(len(docs))] == ids
        assert documents.offsets[name].tolist() == [0, *itertools.accumulate(map(len, ids))]
        assert documents.tokens[name].dtype == np.uint16
        assert not documents.tokens[name].flags.writeable
    blake2b = (hashlib.blake2b("\t".join(doc).encode(), digest_size=8) for doc in docs)
    assert documents.digests.tolist() == [int.from_bytes(h.digest(), "little") for h in blake2b]
