"""Flax NNX modules: parameters (with logical axis names) around the math of ``ops``."""

from flaxformer_lite.lazy import lazy_names

# Each name's module, imported when the name is first read (flaxformer_lite.lazy).
_HOMES = {
    "flaxformer_lite.nn.attention": ("MultiHeadAttention", "Rope"),
    "flaxformer_lite.nn.dense": ("Dense", "KernelInit"),
    "flaxformer_lite.nn.embed": ("Embed",),
    "flaxformer_lite.nn.mlp": ("ACTIVATIONS", "MLP"),
    "flaxformer_lite.nn.norms": ("LayerNorm", "RMSNorm"),
    "flaxformer_lite.nn.positions": ("RelativePositionBias",),
    "flaxformer_lite.nn.sharding": ("ACTIVATION_NAMES", "constrain"),
    "flaxformer_lite.nn.stack": ("REMAT_POLICIES", "LayerStack", "stack_layer_states"),
}
__getattr__, __dir__ = lazy_names(__name__, _HOMES)
__all__ = [name for names in _HOMES.values() for name in names]
