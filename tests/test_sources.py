"""Sources as types (issue 46, item 2): one class per ``data.source`` value behind one protocol,
found in a registry; a source defined outside the package is one class, registered; each
source's fingerprint follows its files."""

import json

import numpy as np
import pytest

from flaxformer_lite.data import readers
from flaxformer_lite.data.config import DataConfig
from flaxformer_lite.data.inputs import current_inputs
from flaxformer_lite.data.pipeline import build_data
from flaxformer_lite.data.sources import SOURCES, FileSource, register, source_of
from flaxformer_lite.data.store import prepare_store
from flaxformer_lite.data.tasks import TASKS

TEXTS = [f"row {i} " + "xyz"[i % 3] * (i % 7) for i in range(40)]


class CsvTextSource(FileSource):
    """``label,text`` lines: the text after the first comma (a source a user adds)."""

    name = "csv_text"

    def records(self, files, on_read=None):
        for path in files:
            for line in readers.iter_lines(path, on_read):
                if line.strip():
                    yield {"text": line.split(",", 1)[1]}


@pytest.fixture
def csv_source(monkeypatch):
    monkeypatch.setitem(SOURCES.entries, CsvTextSource.name, CsvTextSource)


def test_the_registry_holds_every_source_by_its_setting_value():
    assert set(SOURCES) == {"synthetic", "text", "jsonl", "parallel", "prepared"}
    assert all(source.name == name for name, source in SOURCES.items())
    with pytest.raises(ValueError, match="data.source must be one of synthetic, text, "):
        DataConfig(source="csv_text", path="a.csv")


def test_a_source_defined_outside_the_package_trains_end_to_end(tmp_path, csv_source):
    path = tmp_path / "rows.csv"
    path.write_text("".join(f"{i % 2},{text}\n" for i, text in enumerate(TEXTS)))
    cfg = DataConfig(source="csv_text", path=str(path), seq_len=16, tokenizer="char")
    data = build_data(
        cfg,
        task=TASKS["lm"],
        seed=0,
        batch_size=4,
        directory=tmp_path / "tokenizer",
        prepared=tmp_path / "prepared",
    )
    (store,) = (tmp_path / "prepared").iterdir()
    assert store == source_of(cfg).store_at(str(path), tmp_path / "prepared")
    assert store.name.startswith("csv_text-")
    manifest = json.loads((store / "manifest.json").read_text())
    assert manifest["source"]["kind"] == "csv_text"
    # Every record is a text of the file, labels dropped; validation is read again from it.
    assert {r["text"] for r in data.eval_examples} <= set(TEXTS)
    assert 0 < len(data.eval_examples) < len(TEXTS)
    batch = next(data.train)
    assert batch["inputs"].shape == (4, 16)
    text = data.tokenizer.decode(batch["inputs"][0][batch["weights"][0] > 0])
    assert "," not in text and np.any(batch["weights"] > 0)
    # The same source reads from the cached store the second time (made once).
    again = build_data(
        cfg,
        task=TASKS["lm"],
        seed=0,
        batch_size=4,
        directory=tmp_path / "tokenizer",
        prepared=tmp_path / "prepared",
    )
    np.testing.assert_array_equal(next(again.train)["inputs"], batch["inputs"])
    assert len(list((tmp_path / "prepared").iterdir())) == 1


def test_register_adds_a_source_by_its_name(monkeypatch):
    monkeypatch.setattr(SOURCES, "entries", dict(SOURCES.entries))
    assert register(CsvTextSource) is CsvTextSource
    assert SOURCES["csv_text"] is CsvTextSource


def _write(source, directory):
    """One source of ``source`` in ``directory``: its ``data.path`` and the file to change."""
    if source == "jsonl":
        (directory / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
        return str(directory / "a.jsonl"), directory / "a.jsonl"
    if source == "parallel":
        (directory / "s.txt").write_text("\n".join(TEXTS) + "\n")
        (directory / "t.txt").write_text("\n".join(TEXTS[::-1]) + "\n")
        return f"{directory / 's.txt'},{directory / 't.txt'}", directory / "t.txt"
    (directory / "a.txt").write_text("\n".join(TEXTS) + "\n")
    return str(directory / "*.txt"), directory / "a.txt"


@pytest.mark.parametrize("source", ["text", "jsonl", "parallel"])
def test_a_sources_fingerprint_changes_with_its_files_and_only_then(tmp_path, source):
    path, changed = _write(source, tmp_path)
    cfg = DataConfig(source=source, path=path)
    before = current_inputs(cfg)
    assert [f["path"] for f in before["files"]] == [str(p) for p in source_of(cfg).files(path)]
    changed.write_bytes(changed.read_bytes())  # written again, the same bytes
    (tmp_path / "other.csv").write_text("not read by this source\n")
    assert current_inputs(cfg) == before
    with changed.open("a") as file:
        file.write("one more line\n")
    after = current_inputs(cfg)
    sizes = {f["path"]: f["size"] for f in after["files"]}
    assert after != before and sizes[str(changed)] == changed.stat().st_size
    assert after["data"] == before["data"]


def test_a_prepared_stores_fingerprint_is_its_manifests_files(tmp_path):
    corpus = tmp_path / "a.txt"
    corpus.write_text("\n".join(TEXTS) + "\n")
    prepare_store(tmp_path / "store", source="text", path=str(corpus), documents="lines")
    cfg = DataConfig(source="prepared", path=str(tmp_path / "store"))
    (recorded,) = current_inputs(cfg)["files"]
    assert recorded["path"] == str(corpus) and len(recorded["sha256"]) == 64
    corpus.write_text("the store no longer reads this file\n")
    assert current_inputs(cfg)["files"] == [recorded]  # the store is what the run reads


def test_a_synthetic_source_has_no_files_and_takes_no_file_settings():
    cfg = DataConfig(source="synthetic", generator="reverse")
    assert current_inputs(cfg)["files"] == [] and source_of(cfg).files("x") == []
    with pytest.raises(ValueError, match="^data.validation_path needs a file source"):
        DataConfig(source="synthetic", validation_path="v.txt")
    with pytest.raises(ValueError, match="needs data.source text or prepared, not 'jsonl'"):
        DataConfig(source="jsonl", path="a.jsonl", text_documents="lines")
