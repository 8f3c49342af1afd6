"""flaxformer_lite: a readable, exact and shardable JAX/Flax Transformer library."""

__version__ = "0.1.0"
