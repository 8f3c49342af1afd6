"""Downstream evaluations: tasks from local files (HellaSwag, ARC, PIQA, LAMBADA, a text's
perplexity, a multiple-choice task of one's own) scored as lm-evaluation-harness scores them,
while training (``evals`` in the config), after it (``flaxformer-lite evaluate``) and through
lm-eval itself (:mod:`.harness`).

* :mod:`.formats`: task files and their examples;
* :mod:`.requests`: the tokens each example is scored by, packed into rows;
* :mod:`.tasks`: the metrics from the requests' log-likelihoods;
* :mod:`.score`: the model's log-likelihood of each request, on any mesh.
"""

from flaxformer_lite.evals.config import EvalsConfig, TaskFile
from flaxformer_lite.evals.formats import FORMATS, TaskFileError, read_task_file
from flaxformer_lite.evals.requests import Request, encode_pair, pack, rolling_requests
from flaxformer_lite.evals.tasks import Tasks, load_task

# The scoring needs JAX: imported when first named, so that reading task files and configs
# (and every command's --help) does not import it.
_SCORING = ("Scorer", "request_scores")


def __getattr__(name: str):
    if name in _SCORING:
        from flaxformer_lite.evals import score

        return getattr(score, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "FORMATS",
    "EvalsConfig",
    "Request",
    "Scorer",
    "TaskFile",
    "TaskFileError",
    "Tasks",
    "encode_pair",
    "load_task",
    "pack",
    "read_task_file",
    "request_scores",
    "rolling_requests",
]
