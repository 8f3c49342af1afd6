"""A training run's one entry into data/: a :class:`DataRequest` in, the run's
:class:`~flaxformer_lite.data.pipeline.Data` out.

    data = run_data(DataRequest(cfg.data, task=task_of(cfg.model), seed=0, batch_size=32,
                                paths=RunPaths(run.tokenizer, run.prepared, run.inputs)))

Behind it: the stores of a multi-process run prepared once (by the process that writes the run's
files, while the others wait at the request's barrier), the tokenizer saved beside the run, the
pipelines built (:func:`~flaxformer_lite.data.pipeline.build_data`), and the inputs' fingerprint
(:mod:`flaxformer_lite.data.inputs`) recorded for a later resume to compare.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

from flaxformer_lite.data.config import DataConfig
from flaxformer_lite.data.inputs import built_inputs, write_inputs
from flaxformer_lite.data.pipeline import Data, build_data, prepare_run_store
from flaxformer_lite.data.tokenizers import Tokenizer


@dataclasses.dataclass(frozen=True)
class RunPaths:
    """Where a run keeps what its data make: the tokenizer, the prepared stores of its file
    sources, the record of its inputs."""

    tokenizer: Path
    prepared: Path
    inputs: Path


@dataclasses.dataclass(frozen=True)
class DataRequest:
    """What a run asks of data/.

    Attributes:
      data: the data settings.
      task: what the model trains on (``train.step.task_of``).
      seed: the run's seed.
      batch_size: the global batch size.
      paths: the run's paths.
      shard_index, shard_count: which of ``shard_count`` equal blocks of each global batch's
        rows this process makes.
      writer: whether this process writes the run's files (exactly one process per file system).
      barrier: waits until every process of a multi-process run calls it with the same name;
        None for one process.
      tokenizer: the run's given tokenizer (``init_from``'s, with its ids), else None.
    """

    data: DataConfig
    task: str
    seed: int
    batch_size: int
    paths: RunPaths
    shard_index: int = 0
    shard_count: int = 1
    writer: bool = True
    barrier: Callable[[str], None] | None = None
    tokenizer: Tokenizer | None = None


def run_data(request: DataRequest) -> Data:
    """The run's data: this process's share of every batch, the evaluation passes, the
    tokenizer (saved in ``paths.tokenizer`` by the writer) and the notices; the writer records
    the inputs in ``paths.inputs``.

    Raises:
      ValueError, FileNotFoundError: as :func:`~flaxformer_lite.data.pipeline.build_data`.
    """
    paths = request.paths
    if request.barrier is not None:  # the writer fills a shared cache; the others then read it
        if request.writer:
            prepare_run_store(request.data, paths.tokenizer, paths.prepared, request.tokenizer)
        request.barrier("data prepared")
    data = build_data(
        request.data,
        task=request.task,
        seed=request.seed,
        batch_size=request.batch_size,
        directory=paths.tokenizer,
        prepared=paths.prepared,
        process_index=request.shard_index,
        process_count=request.shard_count,
        save_tokenizer=request.writer,
        tokenizer=request.tokenizer,
    )
    if request.writer:
        write_inputs(paths.inputs, built_inputs(request.data, paths.prepared))
    return data
