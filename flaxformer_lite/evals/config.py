"""The ``evals`` section of a run's config: downstream tasks scored while training, each a
file of one of the :data:`~flaxformer_lite.evals.formats.FORMATS`.

    evals:
      every: null                  # steps between them; null: at each evaluation
      tasks:
        hellaswag: {path: data/hellaswag_val.jsonl, limit: 500}
        mine: {format: choice, path: my_task.jsonl}
"""

from __future__ import annotations

import dataclasses

from flaxformer_lite.data.config import METRIC_NAME
from flaxformer_lite.data.readers import BUILTIN
from flaxformer_lite.evals.formats import BUILTIN_TASKS, FORMATS
from flaxformer_lite.settings import setting

DEFAULT_ROWS = 16  # rows of a scoring batch where no run's train.batch_size gives them


@dataclasses.dataclass(frozen=True)
class TaskFile:
    """One downstream task (``evals.tasks.<name>``): its file, the file's format, how many of
    its examples are scored."""

    path: str = setting(
        "",
        help="the task's file (jsonl; a text file for format text), or one of "
        + ", ".join(BUILTIN + name for name in BUILTIN_TASKS),
    )
    format: str | None = setting(
        None,
        help=", ".join(FORMATS) + " (docs/reference.md); null: a built-in task's own, else the "
        "task's name",
    )
    limit: int | None = setting(None, help="score the first this many examples; null: all")

    def __post_init__(self):
        if not self.path:
            raise ValueError("path is required: the task's file")
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"limit must be at least 1 (or null: all), got {self.limit}")


@dataclasses.dataclass(frozen=True)
class EvalsConfig:
    """Downstream tasks scored as lm-evaluation-harness scores them (decoder LMs): their
    metrics are logged as ``task/<name>/<metric>`` beside the evaluation's."""

    tasks: dict[str, TaskFile] = setting(
        factory=dict,
        help="named task files: {hellaswag: {path: hellaswag_val.jsonl}, mine: {format: choice, "
        "path: mine.jsonl, limit: 200}}; {}: none",
    )
    every: int | None = setting(
        None, help="score the tasks every this many steps (and at the end); null: train.eval_every"
    )

    def __post_init__(self):
        for name in self.tasks:
            if not METRIC_NAME.fullmatch(name):
                raise ValueError(
                    f"tasks.{name}: a task's name is letters, digits, '_', '-' and '.' (it is "
                    "part of its metrics' keys, task/<name>/acc)"
                )
        if self.every is not None and self.every < 1:
            raise ValueError(
                f"every must be at least 1 (or null: train.eval_every), got {self.every}"
            )
