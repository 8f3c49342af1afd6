"""Flax NNX modules: parameters (with logical axis names) around the math of ``ops``."""

from flaxformer_lite.nn.attention import MultiHeadAttention, Rope
from flaxformer_lite.nn.dense import Dense, KernelInit
from flaxformer_lite.nn.embed import Embed
from flaxformer_lite.nn.mlp import ACTIVATIONS, MLP
from flaxformer_lite.nn.norms import LayerNorm, RMSNorm
from flaxformer_lite.nn.positions import RelativePositionBias
from flaxformer_lite.nn.sharding import ACTIVATION_NAMES, constrain
from flaxformer_lite.nn.stack import REMAT_POLICIES, LayerStack, stack_layer_states

__all__ = [
    "ACTIVATION_NAMES",
    "ACTIVATIONS",
    "MLP",
    "REMAT_POLICIES",
    "Dense",
    "Embed",
    "KernelInit",
    "LayerNorm",
    "LayerStack",
    "MultiHeadAttention",
    "RMSNorm",
    "RelativePositionBias",
    "Rope",
    "constrain",
    "stack_layer_states",
]
