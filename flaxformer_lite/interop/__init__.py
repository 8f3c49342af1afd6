"""Hugging Face checkpoints in and out: ``load_hf(path) -> (model, config)`` and
``save_hf(model, config, path)`` for GPT-2 (``GPT2LMHeadModel``), Llama (``LlamaForCausalLM``),
BERT (``BertForMaskedLM``, ``BertForSequenceClassification``) and Marian (``MarianMTModel``),
from and to local directories of ``config.json`` + safetensors; ``hf_arguments`` turns Hugging
Face's call arguments into ours."""

from flaxformer_lite.interop.arguments import hf_arguments
from flaxformer_lite.interop.hf import FAMILIES, SUPPORTED, family_of, load_hf, save_hf
from flaxformer_lite.interop.peft import merge_peft, save_peft

__all__ = [
    "FAMILIES",
    "SUPPORTED",
    "family_of",
    "hf_arguments",
    "load_hf",
    "merge_peft",
    "save_hf",
    "save_peft",
]
