"""A run's data as one plan: one value made from the run's data settings and its paths, which a
training run asks for its data, and nothing else of data/.

    plan = DataPlan(cfg.data, task=cfg.task, seed=0, batch_size=32,
                    paths=RunPaths(run.tokenizer, run.prepared, run.inputs),
                    init_from=cfg.init_from)
    data = plan.build()       # batches, evaluation passes, tokenizer, notices; the inputs recorded

The plan's sources are the config's parts (:meth:`~flaxformer_lite.data.config.DataConfig
.parts`: one source is a mixture of one, each part read by its own kind of source). The
tokenizer the run is given is decided here (:func:`given_tokenizer`: ``init_from``'s, with its
ids), the rest where the data are read (:func:`~flaxformer_lite.data.pipeline.run_tokenizer`:
the run's saved one, else the given one, else a mixture's, else the data's own). Behind
:meth:`DataPlan.build`: the stores of a multi-process run prepared once (by the process that
writes the run's files, while the others wait at the plan's barrier), the tokenizer saved beside
the run, the pipelines built (:func:`~flaxformer_lite.data.pipeline.build_data`), and the inputs'
fingerprint (:mod:`flaxformer_lite.data.inputs`) recorded for a later resume to compare.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

from flaxformer_lite.data.config import DataConfig
from flaxformer_lite.data.hf_tokenizer import load_hf_tokenizer
from flaxformer_lite.data.inputs import built_inputs, write_inputs
from flaxformer_lite.data.mixture import check_mixture_sources
from flaxformer_lite.data.pipeline import Data, build_data, prepare_run_store
from flaxformer_lite.data.run_stores import check_sources
from flaxformer_lite.data.tasks import Task
from flaxformer_lite.data.tokenizers import Tokenizer


@dataclasses.dataclass(frozen=True)
class RunPaths:
    """Where a run keeps what its data make: the tokenizer, the prepared stores of its file
    sources, the record of its inputs."""

    tokenizer: Path
    prepared: Path
    inputs: Path


@dataclasses.dataclass(frozen=True)
class DataPlan:
    """A run's data.

    Attributes:
      data: the data settings.
      task: what the model trains on (``TrainConfig.task``).
      seed: the run's seed.
      batch_size: the global batch size.
      paths: the run's paths.
      process_index, process_count: which of ``process_count`` equal blocks of each global
        batch's rows this process makes (processes that feed the same devices' rows share one).
      writer: whether this process writes the run's files (exactly one process per file system).
      barrier: waits until every process of a multi-process run calls it with the same name;
        None for one process.
      init_from: the Hugging Face checkpoint the run starts from, whose tokenizer (and ids) it
        takes; None: the data's.
    """

    data: DataConfig
    task: Task
    seed: int
    batch_size: int
    paths: RunPaths
    process_index: int = 0
    process_count: int = 1
    writer: bool = True
    barrier: Callable[[str], None] | None = None
    init_from: str | Path | None = None

    def build(self) -> Data:
        """The run's data: this process's share of every batch, the evaluation passes, the
        tokenizer (saved in ``paths.tokenizer`` by the writer) and the notices; the writer
        records the inputs in ``paths.inputs``.

        Raises:
          ValueError, FileNotFoundError: as :func:`~flaxformer_lite.data.pipeline.build_data`.
        """
        paths, tokenizer = self.paths, given_tokenizer(self.init_from)
        if self.barrier is not None:  # the writer fills a shared cache; the others then read it
            if self.writer:
                prepare_run_store(self.data, paths.tokenizer, paths.prepared, tokenizer)
            self.barrier("data prepared")
        data = build_data(
            self.data,
            task=self.task,
            seed=self.seed,
            batch_size=self.batch_size,
            directory=paths.tokenizer,
            prepared=paths.prepared,
            process_index=self.process_index,
            process_count=self.process_count,
            save_tokenizer=self.writer,
            tokenizer=tokenizer,
        )
        if self.writer:
            write_inputs(paths.inputs, built_inputs(self.data, paths.prepared))
        return data


def given_tokenizer(init_from: str | Path | None) -> Tokenizer | None:
    """The tokenizer a run is given: the ``init_from`` checkpoint's, with its ids (a resumed run
    reads its saved copy instead); None without one."""
    return None if init_from is None else load_hf_tokenizer(init_from)


def check_data_files(cfg: DataConfig) -> None:
    """Every part's files exist and hold what its source reads, and no part's validation data
    is another's training data: checked before a run or a sweep writes anything.

    Raises:
      ValueError, FileNotFoundError: naming the setting and the file.
    """
    if cfg.mixture:
        check_mixture_sources(cfg.mixture_sources())
    else:
        check_sources(cfg)
