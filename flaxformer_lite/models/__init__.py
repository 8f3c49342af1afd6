"""The three architectures, their layers, configuration and presets, and parameter/FLOP
accounting."""

from flaxformer_lite.models.accounting import (
    generation_flops,
    parameter_counts,
    training_flops_per_token,
)
from flaxformer_lite.models.build import abstract_model, build_model
from flaxformer_lite.models.config import PRESETS, ModelConfig
from flaxformer_lite.models.decoder_lm import DecoderLM
from flaxformer_lite.models.encoder import Encoder
from flaxformer_lite.models.encoder_decoder import EncoderDecoder
from flaxformer_lite.models.layers import TransformerLayer

__all__ = [
    "PRESETS",
    "DecoderLM",
    "Encoder",
    "EncoderDecoder",
    "ModelConfig",
    "TransformerLayer",
    "abstract_model",
    "build_model",
    "generation_flops",
    "parameter_counts",
    "training_flops_per_token",
]
