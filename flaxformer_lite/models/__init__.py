"""The three architectures, their layers, configuration and presets, and parameter/FLOP
accounting."""

from flaxformer_lite.lazy import lazy_names

# Each name's module, imported when the name is first read (flaxformer_lite.lazy).
_HOMES = {
    "flaxformer_lite.models.accounting": (
        "generation_flops",
        "parameter_counts",
        "training_flops_per_token",
    ),
    "flaxformer_lite.models.build": ("abstract_model", "build_model"),
    "flaxformer_lite.models.config": ("PRESETS", "ModelConfig"),
    "flaxformer_lite.models.decoder_lm": ("DecoderLM",),
    "flaxformer_lite.models.encoder": ("Encoder",),
    "flaxformer_lite.models.encoder_decoder": ("EncoderDecoder",),
    "flaxformer_lite.models.layers": ("TransformerLayer",),
}
__getattr__, __dir__ = lazy_names(__name__, _HOMES)
__all__ = [name for names in _HOMES.values() for name in names]
