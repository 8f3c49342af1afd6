"""The records of a text, jsonl or parallel source, and the errors of bad files, each naming
the file and the reason."""

import pytest

from flaxformer_lite.data.sources import source_named


def read(name, path, field="text", documents="lines"):
    """Every record of a source: its files resolved, then read (text: one per line)."""
    source = source_named(name, field, documents)
    return list(source.records(source.files(path)))


def text_records(path, documents="lines"):
    return read("text", path, documents=documents)


def jsonl_records(path, field="text"):
    return read("jsonl", path, field)


def parallel_records(path):
    return read("parallel", path)


def test_text_records_read_a_glob_in_sorted_order_one_record_per_line(tmp_path):
    (tmp_path / "b.txt").write_text("third\n")
    (tmp_path / "a.txt").write_bytes(b"first line\r\n   \n\nsecond  \n")
    (tmp_path / "notes.md").write_text("not matched\n")
    records = text_records(str(tmp_path / "*.txt"))
    assert records == [{"text": "first line"}, {"text": "second  "}, {"text": "third"}]
    # The same files as whole-file documents (the default), as they are.
    whole = text_records(str(tmp_path / "*.txt"), documents="file")
    assert whole == [{"text": "first line\r\n   \n\nsecond  \n"}, {"text": "third\n"}]


def test_jsonl_records_take_the_named_field(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text('{"body": "one", "id": 1}\n\n{"body": "two"}\n')
    assert jsonl_records(str(path), "body") == [{"text": "one"}, {"text": "two"}]


def test_parallel_records_from_tsv_and_from_two_files(tmp_path):
    tsv = tmp_path / "pairs.tsv"
    tsv.write_text("hallo\thello\nwelt\tworld\n")
    src, tgt = tmp_path / "train.de", tmp_path / "train.en"
    src.write_text("hallo\nwelt\n")
    tgt.write_text("hello\nworld\n")
    expected = [{"source": "hallo", "target": "hello"}, {"source": "welt", "target": "world"}]
    assert parallel_records(str(tsv)) == expected
    assert parallel_records(f"{src},{tgt}") == expected


@pytest.mark.parametrize(
    "name, content, read, error, reason",
    [
        ("missing.txt", None, text_records, FileNotFoundError, "file not found"),
        ("empty.txt", b" \n\n", text_records, ValueError, "empty file"),
        ("latin1.txt", b"ok\ncaf\xe9\n", text_records, ValueError, "not valid UTF-8 at line 2"),
        (
            "rows.jsonl",
            b'{"text": "a"}\n{"txt": "b"}\n',
            jsonl_records,
            ValueError,
            r"rows.jsonl:2: no field 'text'",
        ),
        ("bad.jsonl", b'{"text": "a"\n', jsonl_records, ValueError, "bad.jsonl:1: not valid JSON"),
        (
            "pairs.tsv",
            b"a\tb\nno tab\n",
            parallel_records,
            ValueError,
            "pairs.tsv:2: expected source<TAB>target",
        ),
    ],
)
def test_bad_files_raise_errors_naming_the_file_and_reason(
    tmp_path, name, content, read, error, reason
):
    path = tmp_path / name
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(error, match=reason) as info:
        read(str(path))
    assert str(path) in str(info.value)


def test_a_glob_without_matches_and_misaligned_parallel_files_are_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no file matches"):
        text_records(str(tmp_path / "*.txt"))
    src, tgt = tmp_path / "src.txt", tmp_path / "tgt.txt"
    src.write_text("a\nb\nc\n")
    tgt.write_text("x\ny\n")
    with pytest.raises(ValueError, match="has 3 lines but .* has 2") as info:
        parallel_records(f"{src},{tgt}")
    assert str(src) in str(info.value) and str(tgt) in str(info.value)
