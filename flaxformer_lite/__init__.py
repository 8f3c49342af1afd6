"""flaxformer_lite: a readable, exact and shardable JAX/Flax Transformer library.

from flaxformer_lite import load_run, export_run, sweep
run = load_run("runs/default")                        # model, tokenizer, config, step
export_run("runs/default", "exports/default")         # a Hugging Face directory
sweep(cfg, {"seed": [0, 1, 2]})                       # members as one program; mean ± std
register_attention("sigmoid", sigmoid_attention)      # model.attention_implementation=sigmoid
"""

__version__ = "0.1.0"

# Where the names this package exports at its top live; imported on first use, so that
# importing a submodule (``flaxformer_lite.ops``) does not import the training code.
_LAZY = {
    "load_run": "flaxformer_lite.train.trained_run",
    "LoadedRun": "flaxformer_lite.train.trained_run",
    "export_run": "flaxformer_lite.train.export",
    "sweep": "flaxformer_lite.train.sweep",
    "register_attention": "flaxformer_lite.ops.attention_choice",
    "register_mixer": "flaxformer_lite.models.pieces",
    "register_positions": "flaxformer_lite.models.pieces",
    "register_norm": "flaxformer_lite.models.pieces",
    "register_feed_forward": "flaxformer_lite.models.pieces",
    "trusted_code": "flaxformer_lite.models.pieces",
}
__all__ = ["__version__", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'flaxformer_lite' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
