"""Hugging Face's call arguments as ours: ``model(**hf_arguments(**tokenizer_output))``.

A Hugging Face tokenizer gives ``input_ids``, an int 0/1 ``attention_mask`` (1 at real tokens)
and, for BERT, ``token_type_ids``; our models take ``inputs``, a bool ``padding_mask`` (True at
real tokens) and ``token_types``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def hf_arguments(
    input_ids,
    attention_mask=None,
    token_type_ids=None,
) -> dict[str, Any]:
    """Our model's keyword arguments for Hugging Face's.

    Args:
      input_ids: int ``[B, T]`` token ids (numpy or jax).
      attention_mask: int 0/1 (or bool) ``[B, T]``, nonzero at real tokens.
      token_type_ids: int ``[B, T]`` segment ids (BERT).

    Returns:
      ``{"inputs": input_ids, "padding_mask": bool [B, T], "token_types": ...}``, the
      entries of arguments not given left out.

    Raises:
      ValueError: an ``attention_mask`` that is not int or bool ``[B, T]`` like ``input_ids``.
    """
    arguments: dict[str, Any] = {"inputs": input_ids}
    if attention_mask is not None:
        arguments["padding_mask"] = _padding_mask(input_ids, attention_mask)
    if token_type_ids is not None:
        arguments["token_types"] = token_type_ids
    return arguments


def _padding_mask(input_ids, attention_mask) -> jax.Array:
    attention_mask = jnp.asarray(attention_mask)
    shape = jnp.shape(input_ids)[:2]
    valid_dtype = attention_mask.dtype == jnp.bool_ or jnp.issubdtype(
        attention_mask.dtype, jnp.integer
    )
    if attention_mask.shape != shape or not valid_dtype:
        got = f"{attention_mask.dtype}{attention_mask.shape}"
        raise ValueError(
            f"attention_mask must be int 0/1 or bool {list(shape)} like the input_ids, got {got}"
        )
    return attention_mask != 0
