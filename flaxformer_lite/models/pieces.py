"""The pieces of a layer by name: the extension points of :class:`ModelConfig`, each a registry.

  setting                          a name stands for (the contract: in the ``register_`` function)
  model.attention_implementation   ``fn(call: ops.AttentionCall) -> [B, T, H, Dv]``
                                   (``ops.register_attention``)
  model.mixer                      the self-attention sublayer, a module (:func:`register_mixer`)
  model.positions                  a logit bias by positions, a module (:func:`register_positions`);
                                   sinusoidal, learned, rope and none are built into the embedding
                                   and the attention
  model.norm                       a norm over ``[..., D]``, a module (:func:`register_norm`)
  model.feed_forward               the MLP sublayer, a module (:func:`register_feed_forward`)

A setting holds a registered name or an import path ``package.module:attr`` (an installed module
or one in the current directory). The registries are in :mod:`flaxformer_lite.choices` (read by
the config without JAX), the built-in pieces below, named there by import path; ``register_*``
adds a user's, no trust needed for what the running process registered itself. An import path is
imported only inside :func:`~flaxformer_lite.registry.trusted_code` (``--trust-code``,
``trust_code=True``), as transformers' ``trust_remote_code``: a config file or a run's settings
name it, and importing it runs its code. Imported, it is registered under its path. When a model
is built, :func:`check_pieces` traces each piece that is not built in on small shapes, so that a
wrong signature or shape is one line naming the setting, before training starts.
"""

from __future__ import annotations

import hashlib
import inspect
import marshal
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from flax import nnx

from flaxformer_lite import choices
from flaxformer_lite.models.width import attention_scale
from flaxformer_lite.nn.attention import MultiHeadAttention
from flaxformer_lite.nn.attention_free import AttentionFree
from flaxformer_lite.nn.dense import KernelInit, residual_scale
from flaxformer_lite.nn.mlp import MLP
from flaxformer_lite.nn.norms import LayerNorm, RMSNorm
from flaxformer_lite.nn.positions import ALiBi, RelativePositionBias
from flaxformer_lite.ops import attention_choice
from flaxformer_lite.registry import Registry, is_import_path

if TYPE_CHECKING:
    from flaxformer_lite.models.config import ModelConfig


# --------------------------------------------------------------------------- built-in pieces
def residual_init(cfg: ModelConfig, num_layers: int) -> KernelInit:
    """The initializer of projections that write into the residual stream (attention and MLP
    outputs): GPT-2 scales it by ``1 / sqrt(2 * num_layers)`` (``scale_residual_init``)."""
    if cfg.scale_residual_init:
        return cfg.kernel_init.scaled(residual_scale(num_layers))
    return cfg.kernel_init


def attention_options(cfg: ModelConfig, *, num_layers: int, cross: bool = False) -> dict:
    """The keyword arguments of the ``MultiHeadAttention`` ``cfg`` describes, all but ``rngs``:
    a mixer of the user's that subclasses it starts with
    ``super().__init__(**attention_options(cfg, num_layers=num_layers), rngs=rngs)``."""
    return dict(
        d_model=cfg.d_model,
        num_heads=cfg.num_heads,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        cross=cross,
        fused_qkv=cfg.fused_qkv and not cross,
        qkv_bias=cfg.qkv_bias,
        out_bias=cfg.attention_out_bias,
        rope=None if cross else cfg.rope,
        local_window=None if cross else cfg.local_window,
        global_tokens=0 if cross else cfg.global_tokens,
        dropout_rate=cfg.attention_dropout,
        implementation=cfg.attention_implementation,
        scale=attention_scale(cfg),
        init=cfg.kernel_init,
        out_init=residual_init(cfg, num_layers),
        dtype=cfg.dtype,
        param_dtype=cfg.param_dtype,
    )


def self_attention(cfg: ModelConfig, *, num_layers: int, rngs: nnx.Rngs) -> MultiHeadAttention:
    """The mixer ``attention``: multi-head self-attention."""
    return MultiHeadAttention(**attention_options(cfg, num_layers=num_layers), rngs=rngs)


def attention_free(cfg: ModelConfig, *, num_layers: int, rngs: nnx.Rngs) -> AttentionFree:
    """The mixers ``aft_full``, ``aft_local`` and ``aft_simple``: the Attention Free Transformer."""
    return AttentionFree(
        cfg.d_model,
        mixer=cfg.mixer,
        max_length=cfg.max_length,
        window=cfg.aft_window,
        qkv_bias=cfg.qkv_bias,
        out_bias=cfg.attention_out_bias,
        init=cfg.kernel_init,
        out_init=residual_init(cfg, num_layers),
        dtype=cfg.dtype,
        param_dtype=cfg.param_dtype,
        rngs=rngs,
    )


def layer_norm_module(cfg: ModelConfig, *, rngs: nnx.Rngs) -> LayerNorm:
    """The norm ``layernorm`` over D, with a bias if ``norm_bias``."""
    options = dict(eps=cfg.norm_eps, dtype=cfg.dtype, param_dtype=cfg.param_dtype)
    return LayerNorm(cfg.d_model, use_bias=cfg.norm_bias, **options, rngs=rngs)


def rms_norm_module(cfg: ModelConfig, *, rngs: nnx.Rngs) -> RMSNorm:
    """The norm ``rmsnorm`` over D."""
    options = dict(eps=cfg.norm_eps, dtype=cfg.dtype, param_dtype=cfg.param_dtype)
    return RMSNorm(cfg.d_model, **options, rngs=rngs)


def mlp(cfg: ModelConfig, *, num_layers: int, rngs: nnx.Rngs) -> MLP:
    """The feed-forward block ``mlp``: D -> F -> D with ``activation`` (gated: swiglu, geglu)."""
    return MLP(
        cfg.d_model,
        cfg.d_ff,
        activation=cfg.activation,
        use_bias=cfg.mlp_bias,
        init=cfg.kernel_init,
        out_init=residual_init(cfg, num_layers),
        dtype=cfg.dtype,
        param_dtype=cfg.param_dtype,
        rngs=rngs,
    )


def relative_bias(cfg: ModelConfig, *, bidirectional: bool, rngs: nnx.Rngs):
    """The positions ``relative``: T5's learned bias per bucket of distance and head."""
    return RelativePositionBias(
        cfg.num_heads,
        num_buckets=cfg.relative_buckets,
        max_distance=cfg.relative_max_distance,
        bidirectional=bidirectional,
        init=cfg.kernel_init,
        param_dtype=cfg.param_dtype,
        rngs=rngs,
    )


def alibi(cfg: ModelConfig, *, bidirectional: bool, rngs: nnx.Rngs) -> ALiBi:
    """The positions ``alibi``: ALiBi's fixed penalties (symmetric where bidirectional)."""
    return ALiBi(cfg.num_heads)


def register_mixer(name: str, factory: Callable[..., nnx.Module]) -> None:
    """Makes ``factory`` the self-attention sublayer ``model.mixer=name``.

    ``factory(cfg, *, num_layers, rngs)`` builds one layer's module from the
    :class:`ModelConfig` ``cfg`` (``num_layers``: the stack's, for GPT-2's residual init). Its
    call takes ``x [B, T, D]`` and the keywords ``mask`` (bool, broadcastable to
    ``[B, H, T, S]``, or ``None``), ``bias`` (the position bias ``[1, H, T, S]`` or ``None``),
    ``positions`` (``[T]`` or ``[B, T]``, or ``None``: ``arange``), ``is_causal``,
    ``cache_index`` (decoding: write this step's keys at that slot of the cache) and
    ``segment_ids`` (int ``[B, T]`` of packed rows, or ``None``), and returns ``[B, T, D]``. To
    decode with a KV cache it has ``init_cache(batch_size, max_length, *, dtype, num_layers)``.

    The easiest mixer subclasses ``flaxformer_lite.nn.MultiHeadAttention``, built with
    ``attention_options(cfg, num_layers=num_layers)``, and overrides ``attend`` (and ``weights``,
    for attention maps): projections, RoPE, the cache and the mask stay the library's.
    """
    choices.MIXERS.register(name, factory)


def register_positions(name: str, factory: Callable[..., nnx.Module]) -> None:
    """Makes ``factory`` the position scheme ``model.positions=name``: a bias added to every
    layer's attention logits, built once per stack (as T5's relative buckets and ALiBi).

    ``factory(cfg, *, bidirectional, rngs)`` builds the module (``bidirectional``: an encoder's
    stack). Its call takes the query positions ``[T]`` and key positions ``[S]`` (int; when
    decoding, the cache index onwards and the cache's slots) and returns a float bias
    ``[1, H, T, S]`` (``[1, 1, T, S]`` for one shared by the heads).
    """
    choices.POSITION_BIASES.register(name, factory)


def register_norm(name: str, factory: Callable[..., nnx.Module]) -> None:
    """Makes ``factory`` the norm ``model.norm=name`` (of every sublayer, the embedding where
    ``embed_norm`` and the final one): ``factory(cfg, *, rngs)`` builds a module whose call
    maps ``[..., D]`` to ``[..., D]`` (D = ``cfg.d_model``)."""
    choices.NORMS.register(name, factory)


def register_feed_forward(name: str, factory: Callable[..., nnx.Module]) -> None:
    """Makes ``factory`` the feed-forward sublayer ``model.feed_forward=name``:
    ``factory(cfg, *, num_layers, rngs)`` builds one layer's module, whose call maps
    ``x [B, T, D]`` to ``[B, T, D]``."""
    choices.FEED_FORWARDS.register(name, factory)


# --------------------------------------------------------------------------- checks
def user_pieces(cfg: ModelConfig) -> dict[str, str]:
    """Setting -> value of each piece of ``cfg`` that is not built in."""
    found = {}
    for registry, value in piece_settings(cfg):
        if value is not None and not registry.is_builtin(value):
            found[registry.setting] = value
    return found


def piece_sources(cfg: ModelConfig) -> dict[str, str | None]:
    """Setting -> a fingerprint of the code of each of ``cfg``'s pieces that is the user's
    (already imported, by :func:`~.piece_checks.check_pieces`): the sha256 of its module's file
    for an import path, of its source (or compiled code) for a name registered in Python. A
    run records them, and a resume with other code is a change (:mod:`~flaxformer_lite.train
    .resume`)."""
    return {
        registry.setting: _code_fingerprint(registry.resolve(value), value)
        for registry, value in piece_settings(cfg)
        if value is not None and not registry.is_builtin(value)
    }


def _code_fingerprint(obj: Any, value: str) -> str | None:
    """The sha256 of the file of an import path's module, or of a registered object's source
    (of its bytecode where Python kept no source); None for an object that has neither."""
    try:
        if is_import_path(value):
            with open(inspect.getsourcefile(sys.modules[value.partition(":")[0]]), "rb") as file:
                text = file.read()
        else:
            # An attention backend holds the user's function as its ``run``.
            obj = obj.run if isinstance(obj, attention_choice.Backend) else obj
            text = inspect.getsource(obj).encode()
    except (OSError, TypeError, KeyError):
        code = getattr(obj, "__code__", None)
        if code is None:
            return None
        text = marshal.dumps(code)
    return "sha256:" + hashlib.sha256(text).hexdigest()


def piece_settings(cfg: ModelConfig) -> list[tuple[Registry, Any]]:
    positions = None if cfg.positions in choices.BUILTIN_POSITIONS else cfg.positions
    return [
        (choices.ATTENTION, cfg.attention_implementation),
        (choices.MIXERS, cfg.mixer),
        (choices.POSITION_BIASES, positions),
        (choices.NORMS, cfg.norm),
        (choices.FEED_FORWARDS, cfg.feed_forward),
    ]
