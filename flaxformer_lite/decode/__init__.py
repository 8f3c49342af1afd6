"""Generation: KV-cache decoding for decoder LMs and encoder-decoders, sampling, beam search;
from text and back to tokens cut at ``eos`` in :mod:`flaxformer_lite.decode.text`."""

from flaxformer_lite.decode.generate import generate, right_pad, until_eos
from flaxformer_lite.decode.sampling import filter_logits, next_token
from flaxformer_lite.decode.seq2seq import beam_search, seq2seq_generate

__all__ = [
    "beam_search",
    "filter_logits",
    "generate",
    "next_token",
    "right_pad",
    "seq2seq_generate",
    "until_eos",
]
