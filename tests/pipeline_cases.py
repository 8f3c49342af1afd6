"""The corpus and helpers shared by the pipeline tests: a text source's config, its data built
with a run's directories, batches taken and compared."""

import numpy as np

from flaxformer_lite.data.config import DataConfig
from flaxformer_lite.data.pipeline import build_data
from flaxformer_lite.data.tasks import task_named
from flaxformer_lite.data.tokenizers import ByteTokenizer

# 30 distinct lines of 10 to 18 bytes; validation_fraction=0.1 leaves 27 for training.
BYTES = ByteTokenizer()
LINES = [f"sentence {i} " + "xyz"[i % 3] * (i % 7) for i in range(30)]


def write_corpus(tmp_path):
    """``LINES`` in a text file, one per line."""
    path = tmp_path / "corpus.txt"
    path.write_text("\n".join(LINES) + "\n")
    return path


def text_cfg(path, **kwargs):
    """A text source's config, one document per line unless ``text_documents`` says otherwise;
    ``packing="windows"`` packs with ``lm_rows=windows``."""
    kwargs = {"packing": False, "text_documents": "lines", **kwargs}
    if kwargs["packing"] == "windows":
        kwargs.update(packing=True, lm_rows="windows")
    return DataConfig(source="text", path=str(path), **kwargs)


def build(cfg, tmp_path, *, task="lm", seed=0, batch_size=4, directory=None, **kwargs):
    """``build_data`` of the task named ``task`` (an unknown name raises as the lookup does)."""
    directory = directory or tmp_path / "tokenizer"
    kwargs.setdefault("prepared", tmp_path / "prepared")
    return build_data(
        cfg,
        task=task_named(task),
        seed=seed,
        batch_size=batch_size,
        directory=directory,
        **kwargs,
    )


def take(iterator, count):
    return [next(iterator) for _ in range(count)]


def assert_batches_equal(left, right):
    assert len(left) == len(right)
    for a, b in zip(left, right, strict=True):
        assert a.keys() == b.keys()
        for key in a:
            np.testing.assert_array_equal(a[key], b[key], err_msg=key)
