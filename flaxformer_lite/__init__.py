"""flaxformer_lite: a readable, exact and shardable JAX/Flax Transformer library.

from flaxformer_lite import load_run, export_run, sweep
run = load_run("runs/default")                        # model, tokenizer, config, step
export_run("runs/default", "exports/default")         # a Hugging Face directory
sweep(cfg, {"seed": [0, 1, 2]})                       # members as one program; mean ± std
register_attention("sigmoid", sigmoid_attention)      # model.attention_implementation=sigmoid
"""

__version__ = "0.1.0"

from flaxformer_lite.lazy import lazy_names

# Where the names this package exports at its top live; imported on first use, so that
# importing a submodule (``flaxformer_lite.ops``) does not import the training code.
_HOMES = {
    "flaxformer_lite.train.trained_run": ("load_run", "LoadedRun"),
    "flaxformer_lite.train.export": ("export_run",),
    "flaxformer_lite.train.sweep": ("sweep",),
    "flaxformer_lite.ops.attention_choice": ("register_attention",),
    "flaxformer_lite.models.pieces": (
        "register_mixer",
        "register_positions",
        "register_norm",
        "register_feed_forward",
    ),
    "flaxformer_lite.registry": ("trusted_code",),
}
__getattr__, __dir__ = lazy_names(__name__, _HOMES)
__all__ = ["__version__", *(name for names in _HOMES.values() for name in names)]
