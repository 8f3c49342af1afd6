"""Building the model a config describes, concretely or as shapes only."""

from __future__ import annotations

from flax import nnx

from flaxformer_lite.models.config import ModelConfig, ModelKind
from flaxformer_lite.models.decoder_lm import DecoderLM
from flaxformer_lite.models.encoder import Encoder
from flaxformer_lite.models.encoder_decoder import EncoderDecoder
from flaxformer_lite.models.piece_checks import check_pieces

MODEL_CLASSES = {
    ModelKind.ENCODER_DECODER: EncoderDecoder,
    ModelKind.DECODER: DecoderLM,
    ModelKind.ENCODER: Encoder,
}


def build_model(cfg: ModelConfig, *, rngs: nnx.Rngs):
    """The model ``cfg`` describes: ``EncoderDecoder``, ``DecoderLM`` or ``Encoder``.

    Raises:
      ValueError: a piece of the user's (``models.pieces``) is not trusted, does not import, or
        fails on small inputs.
    """
    check_pieces(cfg)
    return MODEL_CLASSES[cfg.kind](cfg, rngs=rngs)


def abstract_model(cfg: ModelConfig):
    """The model with ``jax.ShapeDtypeStruct`` leaves (no memory), for shapes and shardings."""
    return nnx.eval_shape(lambda: build_model(cfg, rngs=nnx.Rngs(0)))
