"""The streaming readers of ``data.sources``: records and errors when files are read in tiny
chunks (lines and multi-byte characters straddling chunk boundaries)."""

import json

import pytest

from flaxformer_lite.data import sources

LINES = ["first line", "", "  ", "héllo wörld ∑ 🎉 日本語", "tab\there", "last line, no break"]


@pytest.fixture
def tiny_chunks(monkeypatch):
    """Chunks of a few bytes: lines and multi-byte characters straddle chunk boundaries."""
    monkeypatch.setattr(sources, "CHUNK_BYTES", 5)


@pytest.mark.parametrize("ending", ["\n", "\r\n"])
def test_streaming_readers_give_the_list_readers_records(tmp_path, tiny_chunks, ending):
    (tmp_path / "a.txt").write_bytes(ending.join(LINES).encode())
    (tmp_path / "b.txt").write_bytes(("one" + ending + "two" + ending).encode())
    files = sources.source_files("text", str(tmp_path / "*.txt"))
    expected = [{"text": t} for t in [*LINES[:1], *LINES[3:], "one", "two"]]
    assert list(sources.iter_text_records(files)) == expected
    rows = [json.dumps({"text": t, "n": 1}, ensure_ascii=False) for t in ["a ∑", "b"]]
    (tmp_path / "c.jsonl").write_text(ending.join(["", *rows]) + ending, encoding="utf-8")
    jsonl = [{"text": "a ∑"}, {"text": "b"}]
    assert list(sources.iter_records("jsonl", [tmp_path / "c.jsonl"])) == jsonl
    (tmp_path / "s.txt").write_text(ending.join(["hallo", "", "welt ∑"]), encoding="utf-8")
    (tmp_path / "t.txt").write_text(ending.join(["hello", "", "world"]), encoding="utf-8")
    pairs = [{"source": "hallo", "target": "hello"}, {"source": "welt ∑", "target": "world"}]
    pair = sources.source_files("parallel", f"{tmp_path / 's.txt'},{tmp_path / 't.txt'}")
    assert list(sources.iter_parallel_records(pair)) == pairs


def test_streaming_reads_in_bounded_chunks_lazily(tmp_path, tiny_chunks):
    path = tmp_path / "a.txt"
    path.write_text("\n".join(f"line {i}" for i in range(1000)) + "\n")
    chunks = []
    records = sources.iter_text_records([path], on_read=lambda p, data: chunks.append(data))
    assert next(records) == {"text": "line 0"}
    assert sum(map(len, chunks)) < 20  # the first record came from the first few chunks
    assert len(list(records)) == 999
    assert max(map(len, chunks)) == 5 and b"".join(chunks) == path.read_bytes()


@pytest.mark.parametrize(
    "content, reason",
    [
        (b"ok\n\xc3\xa9\ncaf\xe9 au lait\n", r"not valid UTF-8 at line 3, byte offset 9"),
        (b"ok\nno break at the end \xff", r"not valid UTF-8 at line 2, byte offset 23"),
        (b" \n\r\n\t", "empty file"),
    ],
)
def test_streaming_errors_name_the_file_line_and_byte(tmp_path, tiny_chunks, content, reason):
    path = tmp_path / "bad.txt"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=reason) as info:
        list(sources.iter_text_records([path]))
    assert str(path) in str(info.value)


def test_streaming_parallel_files_of_other_lengths_are_counted(tmp_path, tiny_chunks):
    src, tgt = tmp_path / "src.txt", tmp_path / "tgt.txt"
    src.write_text("a\nb\nc\nd\n")
    tgt.write_text("x\ny\n")
    for pair, counts in [([src, tgt], (4, 2)), ([tgt, src], (2, 4))]:
        with pytest.raises(ValueError, match=f"has {counts[0]} lines but .* has {counts[1]}"):
            list(sources.iter_parallel_records(pair))
