"""Attention maps: the attention weights every layer and head of a model uses on an input, and
heatmaps of them.

    maps = attention_maps(model, tokens)             # DecoderLM / Encoder: L x [B, H, T, T]
    maps = attention_maps(model, src, tgt)           # {"encoder", "decoder", "cross"} lists
    plot_attention_maps(maps[0][0], labels, labels, "layer0.png")

The weights are the ones the model uses, not a re-implementation of it: every
``MultiHeadAttention`` has a ``sow_weights`` flag, and with it on the module sows
``ops.attention_weights`` of the very ``q, k, bias, mask, is_causal`` it attends with (queries
and keys from its own projections, after RoPE; the padding, causal and segment masks and the
relative / ALiBi biases the model builds). :func:`attention_maps` switches the flag on and
dropout off, runs the model under ``nnx.capture``, and switches both back: the model is neither
copied nor rewired. A scanned layer stack (``scan_layers=True``) sows inside ``nnx.scan``, which
stacks what its layers sow along the scan axis: one map per layer, as from a loop stack.
"""

from __future__ import annotations

import contextlib
import math
import pathlib
from collections.abc import Sequence

import jax
import numpy as np
from flax import nnx

from flaxformer_lite.data.tokenizers import NUM_SPECIAL
from flaxformer_lite.models import DecoderLM, Encoder, EncoderDecoder


def attention_maps(model, inputs, target=None, **kwargs):
    """The attention weights of every layer and head of ``model`` for one batch.

    Args:
      model: a ``DecoderLM``, ``Encoder`` or ``EncoderDecoder``; it is left as it was.
      inputs: int ``[B, T]`` tokens (float ``[B, T, input_dim]`` for continuous inputs): the
        model's input, the source ``[B, S]`` of an ``EncoderDecoder``.
      target: ``EncoderDecoder`` only: the decoder's input ``[B, T]`` (``<sos>`` + target, as in
        training); without it only the encoder's maps are computed.
      **kwargs: keyword arguments of the model call: ``padding_mask`` (bool ``[B, T]``, or the
        source's ``[B, S]``, False at padding); ``positions``, ``segment_ids`` (``DecoderLM``);
        ``token_types``, ``positions``, ``segment_ids`` (``Encoder.encode``);
        ``src_positions``, ``tgt_positions`` (``EncoderDecoder``).

    Returns:
      float32 weights, rows are queries and columns keys; each row sums to 1 (0 where every key
      is masked). ``DecoderLM`` and ``Encoder``: a list over layers of ``[B, H, T, T]``.
      ``EncoderDecoder``: ``{"encoder": [B, H, S, S] per encoder layer, "decoder": [B, H, T, T]
      and "cross": [B, H, T, S] per decoder layer}`` (the last two empty without ``target``).

    Raises:
      TypeError: ``model`` is not one of the three models.
      ValueError: ``target`` for a model that is not an ``EncoderDecoder``, or bad inputs.
    """
    if not isinstance(model, DecoderLM | Encoder | EncoderDecoder):
        raise TypeError(
            f"attention_maps takes a DecoderLM, Encoder or EncoderDecoder, got {type(model)}"
        )
    if target is not None and not isinstance(model, EncoderDecoder):
        raise ValueError(f"target is for an EncoderDecoder; this is a {type(model).__name__}")
    with _switched(model, sow_weights=True, deterministic=True):
        _, sown = nnx.capture(_forward, nnx.Intermediate)(model, inputs, target, kwargs)
    if isinstance(model, EncoderDecoder):
        return {
            "encoder": _layer_maps(model, sown, "encoder", "self_attention"),
            "decoder": _layer_maps(model, sown, "decoder", "self_attention"),
            "cross": _layer_maps(model, sown, "decoder", "cross_attention"),
        }
    tower = "decoder" if isinstance(model, DecoderLM) else "encoder"
    maps = _layer_maps(model, sown, tower, "self_attention")
    if not maps:  # a mixer of the user's that is no MultiHeadAttention and sows nothing
        raise ValueError(
            f"the self-attention mixer {model.config.mixer!r} sowed no attention weights: a "
            "mixer shows maps by sowing nnx.Intermediate 'attention_weights' [B, H, T, S], as "
            "MultiHeadAttention and its subclasses do"
        )
    return maps


def _forward(model, inputs, target, kwargs) -> None:
    """The model's forward pass on one batch: both towers of an ``EncoderDecoder`` with a
    target, the encoder alone without."""
    if isinstance(model, DecoderLM):
        model(inputs, **kwargs)
    elif target is None:
        model.encode(inputs, **kwargs)
    else:
        model(inputs, target, **kwargs)


@contextlib.contextmanager
def _switched(model, **attributes):
    """Sets ``attributes`` on every submodule of ``model`` that has them, and restores each
    module's own values on exit."""
    before = [
        (module, {name: getattr(module, name) for name in attributes if hasattr(module, name)})
        for _, module in nnx.iter_modules(model)
    ]
    model.set_attributes(**attributes, raise_if_not_found=False)
    try:
        yield
    finally:
        for module, values in before:
            for name, value in values.items():
                setattr(module, name, value)


def _layer_maps(model, sown: nnx.State, tower: str, attention: str) -> list[jax.Array]:
    """The ``[B, H, T, S]`` weights that ``attention`` (``self_attention`` or
    ``cross_attention``) sowed in each layer of ``tower``; none where it did not run."""
    stack = getattr(model, tower).layers
    layers = sown.get(tower, {}).get("layers", {}).get("layers", {})
    if stack.scan:  # one module in nnx.scan: its sown weights have a leading layer axis
        found = layers.get(attention, {}).get("attention_weights")
        return [] if found is None else list(found.get_value()[0])
    maps = []
    for i in range(stack.num_layers):
        found = layers.get(i, {}).get(attention, {}).get("attention_weights")
        if found is not None:
            maps.append(found.get_value()[0])
    return maps


# ------------------------------------------------------------------------------ text and plots


def text_inputs(model, tokenizer, text: str, target: str | None = None):
    """Token ids ``[1, T]`` of ``text`` (and ``target``) laid out as the model saw them in
    training (see :mod:`flaxformer_lite.data.pipeline`): ``<sos> text`` for a ``DecoderLM``,
    ``<sos> text <eos>`` for an ``Encoder``; source ``text <eos>`` and decoder input
    ``<sos> target`` for an ``EncoderDecoder``.

    Returns:
      ``(inputs, target_inputs)``: numpy int32 ``[1, T]`` each, ``target_inputs`` None without
      ``target``.

    Raises:
      ValueError: a model reading continuous inputs, or ``target`` for a model without decoder
        cross-attention.
    """
    if model.config.input_dim is not None or model.config.output_dim is not None:
        raise ValueError("this model reads or writes continuous values, not tokens of text")
    if target is not None and not isinstance(model, EncoderDecoder):
        raise ValueError(
            f"a target text is for encoder-decoder models; this is a {type(model).__name__}"
        )
    ids = tokenizer.encode(text)
    if isinstance(model, DecoderLM):
        inputs = [tokenizer.sos_id, *ids]
    elif isinstance(model, Encoder):
        inputs = [tokenizer.sos_id, *ids, tokenizer.eos_id]
    else:
        inputs = [*ids, tokenizer.eos_id]
    targets = None if target is None else [tokenizer.sos_id, *tokenizer.encode(target)]
    return tuple(None if x is None else np.asarray([x], np.int32) for x in (inputs, targets))


def token_labels(tokenizer, ids: Sequence[int]) -> list[str]:
    """A readable tick label per id: specials by name, a space as ``␣``, a byte that is only
    part of a character (byte tokenizer) as ``<0xC3>``."""
    # By the tokenizer's own special ids (a Hugging Face checkpoint's are not 0..3); where two
    # roles share an id (GPT-2's <|endoftext|>), the later name wins.
    roles = ("unk_id", "pad_id", "sos_id", "eos_id")
    names = {getattr(tokenizer, role): f"<{role[:-3]}>" for role in roles}
    labels = []
    for i in np.asarray(ids).reshape(-1).tolist():
        if tokenizer.is_special(i):
            labels.append(names.get(i) or tokenizer.decode([i]) or f"<{i}>")
            continue
        text = tokenizer.decode([i])
        if "\ufffd" in text and tokenizer.name == "byte":
            text = f"<0x{i - NUM_SPECIAL:02X}>"
        labels.append(text.replace(" ", "␣").replace("\n", "\\n").replace("\t", "\\t") or "''")
    return labels


def plot_attention_maps(
    weights,
    row_tokens: Sequence[str],
    col_tokens: Sequence[str],
    path: pathlib.Path | str,
    *,
    title: str | None = None,
) -> pathlib.Path:
    """Writes a PNG of one layer's attention: a grid of heatmaps, one per head.

    Args:
      weights: ``[H, T, S]`` weights of one example (``attention_maps(...)[layer][b]``).
      row_tokens: ``T`` labels of the queries (rows, y axis).
      col_tokens: ``S`` labels of the keys (columns, x axis).
      path: the PNG to write (parent directories are created).
      title: a title above the grid.

    Returns:
      ``path``.

    Raises:
      ValueError: ``weights`` is not ``[H, T, S]`` or the label counts do not match.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    weights = np.asarray(weights, np.float32)
    if weights.ndim != 3:
        raise ValueError(
            f"weights must be one example's [heads, queries, keys], got shape {weights.shape}"
        )
    num_heads, q_len, k_len = weights.shape
    if (len(row_tokens), len(col_tokens)) != (q_len, k_len):
        raise ValueError(
            f"{len(row_tokens)} row and {len(col_tokens)} column labels for weights of "
            f"{q_len} queries and {k_len} keys"
        )
    cols = math.ceil(math.sqrt(num_heads))  # a near-square grid
    rows = math.ceil(num_heads / cols)
    longest = max(q_len, k_len)
    cell = max(3.0, 0.28 * longest)  # inches per heatmap: room for one label per token
    fontsize = max(4.0, min(10.0, 0.45 * cell * 72 / longest))  # about half a row's height
    figure = Figure(figsize=(cols * cell + 1.2, rows * cell + 1.0), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(rows, cols, squeeze=False)
    vmax = max(float(weights.max()), 1e-6)  # one color scale for the layer: heads compare
    image = None
    for head, ax in enumerate(axes.flat):
        if head >= num_heads:
            ax.set_axis_off()
            continue
        image = ax.imshow(
            weights[head],
            cmap="viridis",
            vmin=0.0,
            vmax=vmax,
            aspect="auto",
            interpolation="nearest",
        )
        ax.set_title(f"head {head}", fontsize=fontsize + 2)
        ax.set_xticks(range(k_len), list(col_tokens), fontsize=fontsize)
        for label in ax.get_xticklabels():  # characters read best upright; longer tokens overlap
            label.set_rotation(90 if len(label.get_text()) > 2 else 0)
        ax.set_yticks(range(q_len), list(row_tokens), fontsize=fontsize)
        ax.set_xlabel("key", fontsize=fontsize + 1)
        ax.set_ylabel("query", fontsize=fontsize + 1)
    figure.colorbar(image, ax=axes, shrink=0.6, label="attention weight")
    if title:
        figure.suptitle(title)
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    return path


def write_text_attention_maps(
    model,
    tokenizer,
    text: str,
    out_dir: pathlib.Path | str,
    *,
    target: str | None = None,
    note: str = "",
) -> list[pathlib.Path]:
    """Plots the attention of ``model`` on ``text`` into ``out_dir``, one PNG per layer.

    Files: ``decoder_layer<i>.png`` (``DecoderLM``), ``encoder_layer<i>.png`` (``Encoder`` and
    an ``EncoderDecoder``'s encoder), and with ``target`` ``decoder_layer<i>.png`` and
    ``cross_layer<i>.png`` (an ``EncoderDecoder``'s decoder self- and cross-attention).

    Args:
      model, tokenizer: a trained model and its tokenizer.
      text: the input (the source of an ``EncoderDecoder``), laid out by :func:`text_inputs`.
      out_dir: where the PNGs go (created).
      target: an ``EncoderDecoder``'s target text.
      note: appended to every title (e.g. the checkpoint step).

    Returns:
      The written paths.
    """
    inputs, targets = text_inputs(model, tokenizer, text, target)
    maps = attention_maps(model, inputs, targets)
    source_labels = token_labels(tokenizer, inputs)
    target_labels = None if targets is None else token_labels(tokenizer, targets)
    if isinstance(model, EncoderDecoder):
        parts = {"encoder": ("encoder self-attention", source_labels, source_labels)}
        if target is not None:
            parts["decoder"] = ("decoder self-attention", target_labels, target_labels)
            parts["cross"] = ("cross-attention (target -> source)", target_labels, source_labels)
    else:
        name = "decoder" if isinstance(model, DecoderLM) else "encoder"
        maps = {name: maps}
        parts = {name: (f"{name} self-attention", source_labels, source_labels)}
    out_dir = pathlib.Path(out_dir)
    written = []
    for name, (what, rows, cols) in parts.items():
        for layer, weights in enumerate(maps[name]):
            title = f"{what}, layer {layer}" + (f" ({note})" if note else "")
            path = out_dir / f"{name}_layer{layer}.png"
            written.append(plot_attention_maps(weights[0], rows, cols, path, title=title))
    return written


__all__ = [
    "attention_maps",
    "plot_attention_maps",
    "text_inputs",
    "token_labels",
    "write_text_attention_maps",
]
