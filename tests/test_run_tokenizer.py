"""Which tokenizer a run uses, decided in one place (issue 46, item 1):
:func:`~flaxformer_lite.data.pipeline.run_tokenizer`."""

import pytest

from flaxformer_lite.data.config import DataConfig, MixtureSource
from flaxformer_lite.data.pipeline import build_data, run_tokenizer
from flaxformer_lite.data.tasks import TASKS
from flaxformer_lite.data.tokenizers import ByteTokenizer, CharTokenizer, make_tokenizer


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text("".join(f"line {i} abc\n" for i in range(30)))
    return path


def test_the_runs_saved_tokenizer_comes_first_then_the_given_one(tmp_path, corpus):
    cfg = DataConfig(source="text", path=str(corpus), tokenizer="char")
    directory = tmp_path / "tokenizer"
    assert run_tokenizer(cfg, directory, None) is None  # made with the data, by the store
    given = make_tokenizer("char", texts=["xyz"])
    assert run_tokenizer(cfg, directory, given) is given
    saved = make_tokenizer("char", texts=["abc"])
    saved.save(directory)
    assert run_tokenizer(cfg, directory, None).same_as(saved)
    with pytest.raises(ValueError, match="holds another checkpoint's tokenizer"):
        run_tokenizer(cfg, directory, given)
    byte = DataConfig(source="text", path=str(corpus), tokenizer="byte")
    with pytest.raises(ValueError, match=f"^{directory}: holds a saved 'char' tokenizer"):
        run_tokenizer(byte, directory, None)


def test_a_mixtures_tokenizer_is_decided_before_its_stores_are_made(tmp_path, corpus):
    other = tmp_path / "b.txt"
    other.write_text("".join(f"{i} + {i} = ?\n" for i in range(30)))
    mixture = {"a": MixtureSource(path=str(corpus)), "b": MixtureSource(path=str(other))}
    cfg = DataConfig(source="text", mixture=mixture, tokenizer="char")
    chosen = run_tokenizer(cfg, tmp_path / "tokenizer", None)
    assert isinstance(chosen, CharTokenizer)
    assert chosen.decode(chosen.encode("abc+=?")) == "abc+=?"  # both sources' characters
    data = build_data(
        cfg,
        task=TASKS["lm"],
        seed=0,
        batch_size=2,
        directory=tmp_path / "tokenizer",
        prepared=tmp_path / "prepared",
    )
    assert data.tokenizer.same_as(chosen)
    assert run_tokenizer(cfg, tmp_path / "tokenizer", None).same_as(chosen)  # saved once


def test_a_synthetic_source_fits_the_named_tokenizer_and_saves_it_once(tmp_path):
    cfg = DataConfig(source="synthetic", generator="reverse", tokenizer="byte", train_size=8)
    directory = tmp_path / "tokenizer"
    assert run_tokenizer(cfg, directory, None) is None
    data = build_data(cfg, task=TASKS["lm"], seed=0, batch_size=2, directory=directory)
    assert isinstance(data.tokenizer, ByteTokenizer)
    assert isinstance(run_tokenizer(cfg, directory, None), ByteTokenizer)
