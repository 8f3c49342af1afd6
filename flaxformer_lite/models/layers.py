"""The layer stack of every model: :class:`TransformerLayer` (self-attention, optional
cross-attention and the MLP, each a residual sublayer with its norm before (pre-LN) or after
(post-LN, the paper) the residual sum), and :class:`Tower`, ``num_layers`` of them with their
position bias and final norm.

The layers and their parts are built from a :class:`ModelConfig`: its mixer, norm, feed-forward
block and position bias by name, from the registries of :mod:`flaxformer_lite.choices` (the
built-in pieces are in :mod:`.pieces`; the modules they are made of, ``nn``, take explicit
arguments).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from flaxformer_lite import choices
from flaxformer_lite.models.config import ModelConfig
from flaxformer_lite.models.pieces import attention_options
from flaxformer_lite.nn import context_parallel
from flaxformer_lite.nn.attention import MultiHeadAttention
from flaxformer_lite.nn.rngs import apply_dropout, dropout
from flaxformer_lite.nn.stack import LayerStack


def make_layer_norm(cfg: ModelConfig, rngs: nnx.Rngs) -> nnx.Module:
    """The norm ``cfg.norm`` names (``layernorm``, ``rmsnorm`` or a user's) over D."""
    return choices.NORMS.resolve(cfg.norm)(cfg, rngs=rngs)


def make_cross_attention(cfg: ModelConfig, *, num_layers: int, rngs: nnx.Rngs):
    """The ``MultiHeadAttention`` of a decoder layer over the encoder's output."""
    return MultiHeadAttention(
        **attention_options(cfg, num_layers=num_layers, cross=True), rngs=rngs
    )


class TransformerLayer(nnx.Module):
    """Self-attention, optional cross-attention, MLP.

    The paper's encoder layer (BERT's layer) is bidirectional without cross-attention; its
    decoder layer causal with cross-attention; a decoder-only LM's layer causal without.

    Post-LN (the paper): ``x = Norm(x + Dropout(Sublayer(x)))``. Pre-LN (GPT-2, LLaMA):
    ``x = x + Dropout(Sublayer(Norm(x)))``. A parallel block (GPT-J, PaLM) feeds attention and
    MLP the same input and sums both into the residual: ``x + Attn(Norm(x)) + MLP(Norm(x))``
    (pre-LN) or ``Norm(x + Attn(x) + MLP(x))`` (post-LN).

    Args:
      cfg: the model configuration.
      num_layers: layers in the stack (GPT-2's init scales residual projections by it).
      causal: self-attention sees only earlier positions.
      cross_attention: attend to an encoder's output after self-attention.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        num_layers: int,
        causal: bool,
        cross_attention: bool,
        rngs: nnx.Rngs,
    ):
        self.causal, self.pre_norm = causal, cfg.norm_position == "pre"
        self.parallel = cfg.parallel_block
        self.self_attention = choices.MIXERS.resolve(cfg.mixer)(
            cfg, num_layers=num_layers, rngs=rngs
        )
        self.self_attention_norm = make_layer_norm(cfg, rngs)
        if cross_attention:
            self.cross_attention = make_cross_attention(cfg, num_layers=num_layers, rngs=rngs)
            self.cross_attention_norm = make_layer_norm(cfg, rngs)
        else:
            self.cross_attention = self.cross_attention_norm = None
        self.mlp = choices.FEED_FORWARDS.resolve(cfg.feed_forward)(
            cfg, num_layers=num_layers, rngs=rngs
        )
        # A parallel block normalizes once for both branches.
        self.mlp_norm = None if self.parallel else make_layer_norm(cfg, rngs)
        self.dropout = dropout(cfg.residual_dropout, rngs, "residual")

    def __call__(
        self,
        x: jax.Array,
        context: jax.Array | None = None,
        *,
        mask: jax.Array | None = None,
        bias: jax.Array | None = None,
        context_mask: jax.Array | None = None,
        positions: jax.Array | None = None,
        cache_index: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
    ) -> jax.Array:
        """One layer.

        Args:
          x: ``[B, T, D]``.
          context: ``[B, S, D]`` encoder output (layers with cross-attention).
          mask: self-attention mask, bool broadcastable to ``[B, H, T, T]`` (``T`` -> the cache
            length when decoding); causality is added by the layer.
          bias: self-attention logit bias (relative positions, ALiBi), same shape rules.
          context_mask: cross-attention mask, broadcastable to ``[B, H, T, S]``.
          positions: ``[T]`` or ``[B, T]`` positions for RoPE.
          cache_index: decode through the self-attention KV cache from this slot (and, if
            allocated, the cross-attention cache: ``context=None`` reuses the stored context).
          segment_ids: int ``[B, T]`` of packed rows, for the self-attention (no cache).

        Returns:
          ``[B, T, D]``.
        """

        def self_attention(h):
            return self.self_attention(
                h,
                mask=mask,
                bias=bias,
                positions=positions,
                is_causal=self.causal,
                cache_index=cache_index,
                segment_ids=segment_ids,
            )

        cross_attention = (
            None
            if self.cross_attention is None
            else self._cross(context, context_mask, cache_index)
        )
        if self.parallel:
            h = self.self_attention_norm(x) if self.pre_norm else x
            branches = apply_dropout(self.dropout, self_attention(h)) + apply_dropout(
                self.dropout, self.mlp(h)
            )
            x = x + branches if self.pre_norm else self.self_attention_norm(x + branches)
            if self.cross_attention is not None:
                x = self._sublayer(x, self.cross_attention_norm, cross_attention)
            return x
        x = self._sublayer(x, self.self_attention_norm, self_attention)
        if self.cross_attention is not None:
            x = self._sublayer(x, self.cross_attention_norm, cross_attention)
        return self._sublayer(x, self.mlp_norm, self.mlp)

    def init_cache(
        self,
        batch_size: int,
        max_length: int,
        *,
        context_length: int | None = None,
        dtype=None,
        num_layers: int | None = None,
    ) -> None:
        """Allocates the self-attention KV cache of ``max_length`` slots and, with
        ``context_length``, the cross-attention cache of the context's keys/values;
        ``num_layers`` prefixes a layer axis (the stacked layer of a scanned stack)."""
        self.self_attention.init_cache(batch_size, max_length, dtype=dtype, num_layers=num_layers)
        if context_length is not None and self.cross_attention is not None:
            self.cross_attention.init_cache(
                batch_size, context_length, dtype=dtype, num_layers=num_layers
            )

    def _cross(self, context, context_mask, cache_index):
        cached = cache_index is not None and self.cross_attention.cached_key is not None
        if context is None and not cached:
            raise ValueError("a layer with cross-attention needs the encoder output (context)")
        return lambda h: self.cross_attention(
            h, context, mask=context_mask, cache_index=cache_index
        )

    def _sublayer(self, x, norm, fn):
        if self.pre_norm:
            return x + apply_dropout(self.dropout, fn(norm(x)))
        return norm(x + apply_dropout(self.dropout, fn(x)))


class Tower(nnx.Module):
    """``num_layers`` :class:`TransformerLayer` (a loop or one ``nnx.scan``, ``nn.LayerStack``)
    with their position bias (relative, ALiBi or a user's) and, for pre-LN, the final norm."""

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        num_layers: int,
        causal: bool,
        cross_attention: bool,
        rngs: nnx.Rngs,
    ):
        # The position bias (relative, ALiBi or a user's) keeps the attribute name of T5's
        # relative bias, under which runs' checkpoints hold its table.
        self.relative_bias = (
            None
            if cfg.positions in choices.BUILTIN_POSITIONS
            else choices.POSITION_BIASES.resolve(cfg.positions)(
                cfg, bidirectional=not causal, rngs=rngs
            )
        )

        def make_layer(layer_rngs):
            return TransformerLayer(
                cfg,
                num_layers=num_layers,
                causal=causal,
                cross_attention=cross_attention,
                rngs=layer_rngs,
            )

        self.layers = LayerStack(
            num_layers, make_layer, scan=cfg.scan_layers, remat=cfg.remat, rngs=rngs
        )
        self.final_norm = make_layer_norm(cfg, rngs) if cfg.norm_position == "pre" else None

    def __call__(
        self,
        x,
        context=None,
        *,
        mask=None,
        context_mask=None,
        positions=None,
        cache_index=None,
        kv_length=None,
        segment_ids=None,
    ):
        """``x [B, T, D]`` -> ``[B, T, D]``.

        ``kv_length`` is the self-attention key count (the cache length when decoding; T
        otherwise); ``cache_index`` the first cache slot of ``x``; ``segment_ids`` int
        ``[B, T]`` those of packed rows, for the self-attention.
        """
        length = x.shape[1]
        kv_length = kv_length or length
        bias = None
        if self.relative_bias is not None:
            start = 0 if cache_index is None else cache_index
            # Queries in the layout's order (zig-zag under context parallelism), keys in
            # position order, as the attention gathers them.
            query_positions = start + context_parallel.sequence_order(length)
            bias = self.relative_bias(query_positions, jnp.arange(kv_length))
        x = self.layers(
            x,
            context,
            mask=mask,
            bias=bias,
            context_mask=context_mask,
            positions=positions,
            cache_index=cache_index,
            segment_ids=segment_ids,
        )
        return x if self.final_norm is None else self.final_norm(x)

    def init_cache(
        self, batch_size: int, max_length: int, *, context_length: int | None = None, dtype=None
    ) -> None:
        self.layers.init_cache(batch_size, max_length, context_length=context_length, dtype=dtype)


def key_mask(valid: jax.Array | None) -> jax.Array | None:
    """``[B, S]`` bool (True = real key) -> an attention mask ``[B, 1, 1, S]``."""
    if valid is None:
        return None
    valid = jnp.asarray(valid)
    if valid.ndim != 2 or valid.dtype != jnp.bool_:
        raise ValueError(
            f"a padding mask must be bool [batch, length], got {valid.dtype}{valid.shape}"
        )
    return valid[:, None, None, :]
