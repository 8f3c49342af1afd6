"""The streaming readers of ``data.readers``: records and errors when files are read in tiny
chunks (lines and multi-byte characters straddling chunk boundaries), the ways a text file becomes
documents, compressed files and the built-in texts."""

import gzip
import json
import lzma

import pytest

from flaxformer_lite.data import readers
from flaxformer_lite.data.sources import source_named

LINES = ["first line", "", "  ", "héllo wörld ∑ 🎉 日本語", "tab\there", "last line, no break"]


@pytest.fixture
def tiny_chunks(monkeypatch):
    """Chunks of a few bytes: lines and multi-byte characters straddle chunk boundaries."""
    monkeypatch.setattr(readers, "CHUNK_BYTES", 5)


@pytest.mark.parametrize("ending", ["\n", "\r\n"])
def test_streaming_readers_give_the_list_readers_records(tmp_path, tiny_chunks, ending):
    (tmp_path / "a.txt").write_bytes(ending.join(LINES).encode())
    (tmp_path / "b.txt").write_bytes(("one" + ending + "two" + ending).encode())
    files = readers.expand_files(str(tmp_path / "*.txt"))
    expected = [{"text": t} for t in [*LINES[:1], *LINES[3:], "one", "two"]]
    assert list(readers.iter_text_records(files, "lines")) == expected
    rows = [json.dumps({"text": t, "n": 1}, ensure_ascii=False) for t in ["a ∑", "b"]]
    (tmp_path / "c.jsonl").write_text(ending.join(["", *rows]) + ending, encoding="utf-8")
    jsonl = [{"text": "a ∑"}, {"text": "b"}]
    assert list(source_named("jsonl").records([tmp_path / "c.jsonl"])) == jsonl
    (tmp_path / "s.txt").write_text(ending.join(["hallo", "", "welt ∑"]), encoding="utf-8")
    (tmp_path / "t.txt").write_text(ending.join(["hello", "", "world"]), encoding="utf-8")
    pairs = [{"source": "hallo", "target": "hello"}, {"source": "welt ∑", "target": "world"}]
    pair = source_named("parallel").files(f"{tmp_path / 's.txt'},{tmp_path / 't.txt'}")
    assert list(readers.iter_parallel_records(pair)) == pairs


@pytest.mark.parametrize("ending", ["\n", "\r\n"])
def test_file_documents_keep_each_files_text_exactly(tmp_path, tiny_chunks, ending):
    texts = [
        ending.join(LINES),  # blank and whitespace-only lines, no final break
        ending + ending + "  indented" + ending + ending + ending + "end ∑" + ending + ending,
    ]
    for name, text in zip(("a.txt", "b.txt"), texts, strict=True):
        (tmp_path / name).write_bytes(text.encode())
    files = readers.expand_files(str(tmp_path / "*.txt"))
    expected = [{"text": text} for text in texts]
    assert list(readers.iter_text_records(files)) == expected  # "file" is the default
    assert list(readers.iter_text_records(files, "file")) == expected
    assert list(source_named("text", documents="file").records(files)) == expected


def test_paragraphs_are_runs_of_non_blank_lines_with_their_line_breaks(tmp_path, tiny_chunks):
    (tmp_path / "a.txt").write_text(
        "\n\nfirst para ∑\n  its second line\n\n \t \nsecond\n\n\n\nthird\nlast line, no break",
        encoding="utf-8",
    )
    (tmp_path / "b.txt").write_text("one line\n\n", encoding="utf-8")
    files = readers.expand_files(str(tmp_path / "*.txt"))
    expected = ["first para ∑\n  its second line", "second", "third\nlast line, no break"]
    expected.append("one line")  # the next file starts a new paragraph
    records = list(readers.iter_text_records(files, "paragraphs"))
    assert records == [{"text": text} for text in expected]
    assert list(source_named("text", documents="paragraphs").records(files)) == records


def test_unknown_text_documents_are_refused_naming_the_choices(tmp_path):
    (tmp_path / "a.txt").write_text("a\n")
    with pytest.raises(ValueError, match="unknown text documents 'sentences'.*file, paragraphs"):
        list(readers.iter_text_records([tmp_path / "a.txt"], "sentences"))


@pytest.mark.parametrize("documents", readers.TEXT_DOCUMENTS)
def test_streaming_reads_in_bounded_chunks_lazily(tmp_path, tiny_chunks, documents):
    path = tmp_path / "a.txt"
    path.write_text("\n".join(f"line {i}" for i in range(1000)) + "\n")
    chunks = []
    records = readers.iter_text_records([path], documents, lambda p, data: chunks.append(data))
    if documents == "lines":
        assert next(records) == {"text": "line 0"}
        assert sum(map(len, chunks)) < 20  # the first record came from the first few chunks
        assert len(list(records)) == 999
    elif documents == "paragraphs":  # one run of non-blank lines: the text, minus its end
        assert list(records) == [{"text": path.read_text().removesuffix("\n")}]
    else:
        assert list(records) == [{"text": path.read_text()}]
    assert max(map(len, chunks)) == 5 and b"".join(chunks) == path.read_bytes()


@pytest.mark.parametrize("documents", readers.TEXT_DOCUMENTS)
@pytest.mark.parametrize(
    "content, reason",
    [
        (b"ok\n\xc3\xa9\ncaf\xe9 au lait\n", r"not valid UTF-8 at line 3, byte offset 9"),
        (b"ok\nno break at the end \xff", r"not valid UTF-8 at line 2, byte offset 23"),
        (b" \n\r\n\t", "empty file"),
    ],
)
def test_streaming_errors_name_the_file_line_and_byte(
    tmp_path, tiny_chunks, content, reason, documents
):
    path = tmp_path / "bad.txt"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=reason) as info:
        list(readers.iter_text_records([path], documents))
    assert str(path) in str(info.value)


def test_streaming_parallel_files_of_other_lengths_are_counted(tmp_path, tiny_chunks):
    src, tgt = tmp_path / "src.txt", tmp_path / "tgt.txt"
    src.write_text("a\nb\nc\nd\n")
    tgt.write_text("x\ny\n")
    for pair, counts in [([src, tgt], (4, 2)), ([tgt, src], (2, 4))]:
        with pytest.raises(ValueError, match=f"has {counts[0]} lines but .* has {counts[1]}"):
            list(readers.iter_parallel_records(pair))


# --- compressed files and built-in texts -----------------------------------------------------

COMPRESS = {"gz": gzip.compress, "xz": lzma.compress}


@pytest.mark.parametrize("suffix", sorted(COMPRESS))
@pytest.mark.parametrize("documents", readers.TEXT_DOCUMENTS)
def test_compressed_files_give_the_plain_files_records(tmp_path, tiny_chunks, suffix, documents):
    text = "\n".join(f"line {i} ∑ 🎉" + "\n" * (i % 3 == 0) for i in range(3000)) + "\r\n"
    plain = tmp_path / "plain" / "a.txt"
    packed = tmp_path / "packed" / f"a.txt.{suffix}"
    for path in (plain, packed):
        path.parent.mkdir()
    plain.write_text(text, encoding="utf-8")
    packed.write_bytes(COMPRESS[suffix](plain.read_bytes()))
    assert packed.stat().st_size < plain.stat().st_size  # really compressed
    expected = list(readers.iter_text_records([plain], documents))
    assert len(expected) > 1 or documents == "file"
    chunks = []
    (found,) = readers.expand_files(str(tmp_path / "packed" / "*"))
    records = readers.iter_text_records([found], documents, lambda p, data: chunks.append(data))
    assert list(records) == expected
    # on_read sees the file's own (compressed) bytes, as a store hashes them.
    assert sum(map(len, chunks)) == packed.stat().st_size
    assert b"".join(chunks) == packed.read_bytes()


@pytest.mark.parametrize("suffix", sorted(COMPRESS))
def test_a_damaged_compressed_file_is_named(tmp_path, suffix):
    path = tmp_path / f"a.txt.{suffix}"
    path.write_bytes(COMPRESS[suffix](b"some text\n" * 1000)[:-20])  # cut short
    with pytest.raises(ValueError, match="cannot read") as info:
        list(readers.iter_text_records([path]))
    assert str(path) in str(info.value)


def test_a_corrupt_deflate_stream_in_a_gz_is_named(tmp_path):
    """Issue 43 item 10: damaged bytes inside the stream raised zlib.error, a traceback."""
    path = tmp_path / "a.txt.gz"
    packed = bytearray(gzip.compress(b"some text\n" * 1000))
    packed[20:30] = b"\xff" * 10  # inside the deflate stream, after the header
    path.write_bytes(bytes(packed))
    with pytest.raises(ValueError, match=f"^{path}: cannot read \\(") as info:
        list(readers.iter_text_records([path]))
    assert len(str(info.value).splitlines()) == 1


def test_builtin_tinyshakespeare_resolves_and_reads():
    (path,) = readers.expand_files("builtin:tinyshakespeare")
    assert path.is_file() and path.suffix == ".xz"
    (record,) = readers.iter_text_records([path])
    assert record["text"].startswith("First Citizen:\nBefore we proceed any further")
    assert len(record["text"]) == 1_115_394  # Karpathy's input.txt, whole


def test_an_unknown_builtin_text_is_named():
    with pytest.raises(FileNotFoundError, match="builtin:nosuchbook") as info:
        readers.expand_files("builtin:nosuchbook")
    assert "builtin:tinyshakespeare" in str(info.value)  # the names there are
