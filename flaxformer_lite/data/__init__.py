"""Data: tokenizers, sources (text, JSONL, parallel files, prepared stores), built-in synthetic
generators and the pipelines that turn them into deterministic, resumable, per-process batches.

The names below are what the rest of the package asks of data/ (train/ imports nothing else):
a run's data through its :class:`DataPlan`, the settings, the tasks, the tokenizers, the
record of a run's inputs and what an export writes. Each is imported on first use
(:mod:`flaxformer_lite.lazy`), so the config reads without the pipelines.
"""

from flaxformer_lite.lazy import lazy_names

_HOMES = {
    "flaxformer_lite.data.config": ("DataConfig", "MixtureSource", "settled_parts"),
    "flaxformer_lite.data.plan": (
        "Data",
        "DataPlan",
        "RunPaths",
        "check_data_files",
        "given_tokenizer",
    ),
    "flaxformer_lite.data.tasks": ("TASKS", "Task", "task_named"),
    "flaxformer_lite.data.generator": ("Generator", "split_prompt"),
    "flaxformer_lite.data.documents": ("TEXT_RECORDS",),
    "flaxformer_lite.data.tokenizers": ("NAME_FILE", "Tokenizer", "load_tokenizer"),
    "flaxformer_lite.data.hf_tokenizer": ("load_hf_tokenizer",),
    "flaxformer_lite.data.inputs": (
        "current_inputs",
        "file_changes",
        "read_inputs",
        "setting_changes",
        "store_of",
    ),
    "flaxformer_lite.data.store": ("owner", "remove_stale_partials"),
    "flaxformer_lite.data.tokenizer_export": ("hf_tokenizer_files",),
}
__getattr__, __dir__ = lazy_names(__name__, _HOMES)
__all__ = [name for names in _HOMES.values() for name in names]
