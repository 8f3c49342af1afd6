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
or one in the current directory). The built-in pieces are registered below: they are each
registry's first users; ``register_*`` adds a user's, no trust needed for what the running process
registered itself. An import path is imported only inside :func:`trusted_code` (``--trust-code``,
``trust_code=True``), as transformers' ``trust_remote_code``: a config file or a run's settings
name it, and importing it runs its code. Imported, it is registered under its path. When a model
is built, :func:`check_pieces` traces each piece that is not built in on small shapes, so that a
wrong signature or shape is one line naming the setting, before training starts.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import importlib
import inspect
import marshal
import os
import re
import sys
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from flax import nnx

from flaxformer_lite.models.width import attention_scale
from flaxformer_lite.nn.attention import MultiHeadAttention
from flaxformer_lite.nn.attention_free import AFT_MIXERS, AttentionFree
from flaxformer_lite.nn.dense import KernelInit, residual_scale
from flaxformer_lite.nn.mlp import MLP
from flaxformer_lite.nn.norms import LayerNorm, RMSNorm
from flaxformer_lite.nn.positions import ALiBi, RelativePositionBias
from flaxformer_lite.ops import attention_choice

if TYPE_CHECKING:
    from flaxformer_lite.models.config import ModelConfig

IMPORT_PATH = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")
TRUST_FLAG = "--trust-code (trust_code=True in Python)"

_TRUSTED: contextvars.ContextVar[bool] = contextvars.ContextVar("trusted_code", default=False)


@contextlib.contextmanager
def trusted_code(trust: bool = True) -> Iterator[None]:
    """Within the block, import paths in model settings are imported if ``trust`` (the
    commands' ``--trust-code``; ``load_run(..., trust_code=True)`` and the like use this). A
    block inside a trusted one stays trusted."""
    token = _TRUSTED.set(_TRUSTED.get() or bool(trust))
    try:
        yield
    finally:
        _TRUSTED.reset(token)


def is_import_path(value: Any) -> bool:
    """Whether ``value`` is written as an import path ``package.module:attr``."""
    return isinstance(value, str) and IMPORT_PATH.match(value) is not None


class Registry:
    """The names one setting accepts, each standing for an object that meets ``contract``.

    Args:
      setting: the setting, ``model.mixer``.
      contract: what a registered object is, in a line (for error messages).
      entries: name -> object; the names present at construction are the built-in ones.
      add: registers ``(name, obj)`` in ``entries`` (by default a plain assignment).
    """

    def __init__(
        self,
        setting: str,
        contract: str,
        entries: dict[str, Any],
        add: Callable[[str, Any], None] | None = None,
    ):
        self.setting, self.contract, self.entries = setting, contract, entries
        self.builtin = frozenset(entries)
        self._add = add or entries.__setitem__

    def register(self, name: str, obj: Any) -> None:
        """Makes ``obj`` the piece ``name`` (replacing a name registered before, not a built-in
        one); settings and overrides then take ``name``."""
        if not isinstance(name, str) or not re.fullmatch(r"[\w.-]+", name):
            raise ValueError(
                f"a {self.setting} name is letters, digits, _, - and ., got {name!r} (import "
                "paths module:attr need no registering)"
            )
        if name in self.builtin:
            raise ValueError(f"{self.setting}={name!r} is built in; register under another name")
        if not callable(obj):
            raise ValueError(f"{self.setting}={name!r} must be callable ({self.contract})")
        self._add(name, obj)

    def check(self, value: Any) -> None:
        """Raises a ValueError unless ``value`` is a registered name or an import path; a plain
        name is said to be maybe one registered in another process (a run's config names the
        piece, not its code)."""
        if value in self.entries or is_import_path(value):
            return
        setting = self.setting.removeprefix("model.")
        unknown = (
            f"{setting} must be one of {tuple(self.entries)} or an import path module:attr, got "
            f"{value!r}"
        )
        if isinstance(value, str) and re.fullmatch(r"[\w.-]+", value):
            unknown += (
                f"; a name registered in Python lasts as long as its process: register "
                f"{value!r} again in this one (flaxformer_lite.register_"
                f"{setting.removesuffix('_implementation')}), or name the code by import path"
            )
        raise ValueError(unknown)

    def get(self, value: str) -> Any:
        """The object ``value`` names; an import path is imported (only in trusted code) and
        registered under its path.

        Raises:
          ValueError: an unknown name; an import path outside :func:`trusted_code`, that does
            not import, or whose attribute is missing or not callable.
        """
        if value in self.entries:
            return self.entries[value]
        self.check(value)
        module_name, _, attr = value.partition(":")
        if not _TRUSTED.get():
            raise ValueError(
                f"{self.setting}={value!r} names code to import (module {module_name}); "
                f"importing runs it: pass {TRUST_FLAG} if you trust it"
            )
        obj = _imported(module_name, self.setting, value)
        for part in attr.split("."):
            if not hasattr(obj, part):
                raise ValueError(f"{self.setting}={value!r}: {module_name} has no attribute {attr}")
            obj = getattr(obj, part)
        if not callable(obj):
            raise ValueError(
                f"{self.setting}={value!r} is a {type(obj).__name__}, not callable; expected "
                f"{self.contract}"
            )
        self._add(value, obj)
        return obj

    def is_builtin(self, value: Any) -> bool:
        return value in self.builtin


def _imported(module_name: str, setting: str, value: str):
    """The module ``module_name``, imported with the current directory on the path (as
    ``python -m`` has it)."""
    cwd = os.getcwd()
    added = cwd not in sys.path and "" not in sys.path
    if added:
        sys.path.insert(0, cwd)
    try:
        return importlib.import_module(module_name)
    except Exception as error:  # the user's module may raise anything while importing
        raise ValueError(
            f"{setting}={value!r}: importing {module_name} failed "
            f"({type(error).__name__}: {first_line(error)})"
        ) from error
    finally:
        if added:
            sys.path.remove(cwd)


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


def layer_norm(cfg: ModelConfig, *, rngs: nnx.Rngs) -> LayerNorm:
    """The norm ``layernorm`` over D, with a bias if ``norm_bias``."""
    options = dict(eps=cfg.norm_eps, dtype=cfg.dtype, param_dtype=cfg.param_dtype)
    return LayerNorm(cfg.d_model, use_bias=cfg.norm_bias, **options, rngs=rngs)


def rms_norm(cfg: ModelConfig, *, rngs: nnx.Rngs) -> RMSNorm:
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


# --------------------------------------------------------------------------- the registries
ATTENTION = Registry(
    "model.attention_implementation",
    "fn(call: ops.AttentionCall) -> [B, T, H, Dv]",
    attention_choice.BACKENDS,
    add=attention_choice.register_attention,
)
MIXERS = Registry(
    "model.mixer",
    "factory(cfg, *, num_layers, rngs) -> a module: x [B, T, D] and the keywords mask, bias, "
    "positions, is_causal, cache_index, segment_ids -> [B, T, D]",
    {"attention": self_attention, **dict.fromkeys(AFT_MIXERS, attention_free)},
)
POSITION_BIASES = Registry(
    "model.positions",
    "factory(cfg, *, bidirectional, rngs) -> a module: query positions [T], key positions [S] "
    "-> a logit bias [1, H, T, S]",
    {"relative": relative_bias, "alibi": alibi},
)
# Position schemes that are not a logit bias: the embedding adds sinusoidal and learned ones,
# the attention rotates queries and keys by RoPE.
BUILTIN_POSITIONS = ("sinusoidal", "learned", "rope", "none")
NORMS = Registry(
    "model.norm",
    "factory(cfg, *, rngs) -> a module: [..., D] -> [..., D]",
    {"layernorm": layer_norm, "rmsnorm": rms_norm},
)
FEED_FORWARDS = Registry(
    "model.feed_forward",
    "factory(cfg, *, num_layers, rngs) -> a module: x [B, T, D] -> [B, T, D]",
    {"mlp": mlp},
)


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
    MIXERS.register(name, factory)


def register_positions(name: str, factory: Callable[..., nnx.Module]) -> None:
    """Makes ``factory`` the position scheme ``model.positions=name``: a bias added to every
    layer's attention logits, built once per stack (as T5's relative buckets and ALiBi).

    ``factory(cfg, *, bidirectional, rngs)`` builds the module (``bidirectional``: an encoder's
    stack). Its call takes the query positions ``[T]`` and key positions ``[S]`` (int; when
    decoding, the cache index onwards and the cache's slots) and returns a float bias
    ``[1, H, T, S]`` (``[1, 1, T, S]`` for one shared by the heads).
    """
    POSITION_BIASES.register(name, factory)


def register_norm(name: str, factory: Callable[..., nnx.Module]) -> None:
    """Makes ``factory`` the norm ``model.norm=name`` (of every sublayer, the embedding where
    ``embed_norm`` and the final one): ``factory(cfg, *, rngs)`` builds a module whose call
    maps ``[..., D]`` to ``[..., D]`` (D = ``cfg.d_model``)."""
    NORMS.register(name, factory)


def register_feed_forward(name: str, factory: Callable[..., nnx.Module]) -> None:
    """Makes ``factory`` the feed-forward sublayer ``model.feed_forward=name``:
    ``factory(cfg, *, num_layers, rngs)`` builds one layer's module, whose call maps
    ``x [B, T, D]`` to ``[B, T, D]``."""
    FEED_FORWARDS.register(name, factory)


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
        registry.setting: _code_fingerprint(registry.get(value), value)
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
    positions = None if cfg.positions in BUILTIN_POSITIONS else cfg.positions
    return [
        (ATTENTION, cfg.attention_implementation),
        (MIXERS, cfg.mixer),
        (POSITION_BIASES, positions),
        (NORMS, cfg.norm),
        (FEED_FORWARDS, cfg.feed_forward),
    ]


def first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0][:300] if text else ""
