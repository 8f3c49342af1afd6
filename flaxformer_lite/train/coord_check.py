"""muP's coordinate check (Yang et al. 2022, Tensor Programs V, appendix D; the ``mup`` package's
``get_coord_data`` and ``plot_coord_data``): train the same model at several widths for a few
steps on one fixed batch, and record the mean absolute coordinate ``mean |x|`` of what each module
outputs. Under a parametrization that is right for the width, every curve of it against the width
is flat at every step; one that grows with the width (the standard parametrization's hidden
outputs and logits after a few Adam steps) blows up in a wider model.

The modules: the token (and position) tables, each ``Dense`` (grouped over the layers by its path
inside a layer, ``layers/mlp/wo``), each layer's output (``layers/output``) and the logits. Their
outputs are caught by wrapping the classes' ``__call__`` for the length of an eager forward pass
(:func:`recording`); the steps themselves are jitted.

    result = coord_check(load_config("shakespeare_char"), [64, 128, 256])
    result["scales"]["logits"][1][4]   # mean |logits| at width 128 after 4 steps
    plot_coord_check(result, pathlib.Path("coords/coord_check.png"))
"""

from __future__ import annotations

import contextlib
import functools
import math
import pathlib
import time
from collections import defaultdict
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from flaxformer_lite import ops
from flaxformer_lite.data import TASKS
from flaxformer_lite.models import build_model
from flaxformer_lite.models.config import ModelConfig, ModelKind
from flaxformer_lite.models.heads import OutputHead
from flaxformer_lite.models.layers import TransformerLayer
from flaxformer_lite.nn.dense import Dense
from flaxformer_lite.nn.embed import Embed
from flaxformer_lite.train.config import TrainConfig
from flaxformer_lite.train.figures import draw, pyplot
from flaxformer_lite.train.optim import make_optimizer
from flaxformer_lite.train.step import model_loss

# The modules whose outputs are recorded; each defines its own ``__call__``.
RECORDED = (Embed, Dense, TransformerLayer, OutputHead)
# The token ids of the fixed batch: one key for every width and seed, so that only the width and
# the initialization differ between the curves' points.
BATCH_SEED = 0
# At most this many panels (steps) in a figure; more steps are thinned evenly, first and last kept.
MOST_PANELS = 8


def width_config(model: ModelConfig, width: int) -> ModelConfig:
    """``model`` at ``d_model = width``: ``d_ff = 4 * width``, the heads kept and ``head_dim``
    derived, the layers a loop (each layer its own module, to be recorded), no dropout.

    Raises:
      ValueError: the config refuses the width (``mup_base_width`` above it, a width the heads
        do not divide).
    """
    return model.replace(
        d_model=width,
        d_ff=None,
        head_dim=None,
        scan_layers=False,
        embedding_dropout=0.0,
        attention_dropout=0.0,
        residual_dropout=0.0,
    )


def group_of(path: tuple, module: nnx.Module) -> str:
    """The group of a recorded module at graph ``path``: a layer's own modules by their path
    inside the layer (``("decoder", "layers", "layers", 3, "mlp", "wo")`` -> ``layers/mlp/wo``),
    a layer's output ``layers/output``, the output head's ``logits``, others by their path
    (``embed/tokens``)."""
    if isinstance(module, OutputHead):
        return "logits"
    indices = [i for i, key in enumerate(path) if isinstance(key, int)]
    if not indices:
        return "/".join(map(str, path))
    inside = path[indices[-1] + 1 :]
    return "/".join(["layers", *map(str, inside)]) if inside else "layers/output"


@contextlib.contextmanager
def recording(model: nnx.Module):
    """Within it, each call of a :data:`RECORDED` module of ``model`` appends ``mean |output|``
    (a Python float, over every coordinate of the output) to ``records[group]``
    (:func:`group_of`), ``records`` being what it yields; the classes' ``__call__`` are restored
    after. Run the model eagerly inside it: under a trace the outputs have no values."""
    groups = {
        id(node): group_of(path, node)
        for path, node in nnx.iter_graph(model)
        if isinstance(node, RECORDED)
    }
    records: dict[str, list[float]] = defaultdict(list)
    originals = {cls: cls.__dict__["__call__"] for cls in RECORDED}

    def recorded(call):
        @functools.wraps(call)
        def wrapper(self, *args, **kwargs):
            out = call(self, *args, **kwargs)
            group = groups.get(id(self))  # other models' modules run as before
            if group is not None:
                records[group].append(float(jnp.mean(jnp.abs(out.astype(jnp.float32)))))
            return out

        return wrapper

    for cls, call in originals.items():
        cls.__call__ = recorded(call)
    try:
        yield records
    finally:
        for cls, call in originals.items():
            cls.__call__ = call


def fixed_batch(model: ModelConfig, *, batch_size: int, seq_len: int) -> dict[str, jax.Array]:
    """The ``lm`` batch of every width and seed: ``inputs`` and ``targets`` int32 ``[B, T]``,
    a random sequence of ``T + 1`` token ids and its next tokens; ``weights`` float32 ``[B, T]``
    of ones."""
    key = jax.random.key(BATCH_SEED)
    tokens = jax.random.randint(key, (batch_size, seq_len + 1), 0, model.vocab_size, jnp.int32)
    weights = jnp.ones((batch_size, seq_len), jnp.float32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "weights": weights}


@nnx.jit
def _train_step(model, optimizer, batch):
    def loss_of(model):
        return model_loss(model, batch, task=TASKS["lm"])[0]

    optimizer.update(model, nnx.grad(loss_of)(model))


def _forward(model, batch: dict) -> tuple[dict[str, float], float]:
    """One eager forward pass: ``({group: mean |x| over its layers}, loss)``."""
    with recording(model) as records:
        logits = TASKS["lm"].predict(model, batch, features=False)
    loss, _ = ops.cross_entropy(logits, batch["targets"], weights=batch["weights"])
    return {group: float(np.mean(values)) for group, values in records.items()}, float(loss)


def coord_check(
    cfg: TrainConfig,
    widths: list[int],
    *,
    steps: int = 4,
    seeds: int = 2,
    batch_size: int = 8,
    log: Callable[[str], None] | None = None,
) -> dict:
    """The coordinate check of ``cfg``'s model and optimizer at each of ``widths``.

    Each width's model (:func:`width_config`) is built for each seed ``s`` from
    ``nnx.Rngs(params=s, dropout=s + 1)`` and trained ``steps`` steps of ``cfg.optimizer`` (its
    schedule spanning them) on one :func:`fixed_batch` of ``[batch_size, data.seq_len]``; before
    the first step and after each, an eager forward pass records each group's ``mean |x|``.
    ``log`` gets a line per width.

    Returns:
      ``{"widths": [W], "steps": [0, ..., steps], "scales": {group: [W][steps + 1]} (mean over
      the layers and seeds), "loss": [W][steps + 1] (the batch's, mean over seeds),
      "parametrization", "mup_base_width", "optimizer", "lr"}``.

    Raises:
      ValueError: a model that is not a decoder LM of token ids and logits, or a width the
        config refuses.
    """
    model_cfg = cfg.model
    decoder = model_cfg.kind is ModelKind.DECODER
    if not decoder or model_cfg.input_dim is not None or model_cfg.output_dim:
        what = "a decoder LM of continuous inputs or outputs" if decoder else ""
        raise ValueError(
            f"the coordinate check trains decoder LMs on token ids (model kind 'decoder'); the "
            f"config's model is {what or f'of kind {str(model_cfg.kind)!r}'}"
        )
    widths = sorted(set(widths))
    configs = [width_config(model_cfg, width) for width in widths]  # refuses a width up front
    batch = fixed_batch(model_cfg, batch_size=batch_size, seq_len=cfg.data.seq_len)
    scales: dict[str, np.ndarray] = {}
    losses = np.zeros((len(widths), steps + 1))
    for w, (width, width_cfg) in enumerate(zip(widths, configs, strict=True)):
        started = time.perf_counter()
        # One transformation for the seeds: the jitted step's cache keys on it.
        tx, _ = make_optimizer(cfg.optimizer, width_cfg, total_steps=steps)
        for seed in range(seeds):
            model = build_model(width_cfg, rngs=nnx.Rngs(params=seed, dropout=seed + 1))
            optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
            for t in range(steps + 1):
                if t:
                    _train_step(model, optimizer, batch)
                found, loss = _forward(model, batch)
                losses[w, t] += loss / seeds
                for group, value in found.items():
                    table = scales.setdefault(group, np.zeros((len(widths), steps + 1)))
                    table[w, t] += value / seeds
        if log is not None:
            spent = time.perf_counter() - started
            log(f"width {width}: {seeds} seed(s) x {steps} steps, {spent:.1f}s")
    return {
        "widths": widths,
        "steps": list(range(steps + 1)),
        "scales": {group: table.tolist() for group, table in sorted(scales.items())},
        "loss": losses.tolist(),
        "seeds": seeds,
        "parametrization": model_cfg.parametrization,
        "mup_base_width": model_cfg.mup_base_width,
        "optimizer": cfg.optimizer.name,
        "lr": cfg.optimizer.lr,
    }


def title_of(result: dict) -> str:
    """The parametrization (with muP's base width), optimizer and learning rate of ``result``."""
    what = result["parametrization"]
    if result.get("mup_base_width") is not None:
        what += f" (base width {result['mup_base_width']})"
    return f"coordinate check: {what}, {result['optimizer']} lr {result['lr']:g}"


def panel_steps(steps: list[int], most: int = MOST_PANELS) -> list[int]:
    """The steps that get a panel: all of them, or ``most`` spread evenly, first and last kept."""
    if len(steps) <= most:
        return list(steps)
    picks = np.linspace(0, len(steps) - 1, most).round().astype(int)
    return [steps[i] for i in sorted(set(picks.tolist()))]


def plot_coord_check(result: dict, path: pathlib.Path) -> pathlib.Path:
    """Writes ``path``: a panel per step ``t`` (:func:`panel_steps`), mean ``|x|`` (log axis)
    against the width (log2 axis), a line per group; returns ``path``."""
    from matplotlib import ticker

    plt = pyplot()
    shown = panel_steps(result["steps"])
    # One row for a few steps, as the mup package draws them; two rows for more.
    columns = len(shown) if len(shown) <= 5 else math.ceil(len(shown) / 2)
    rows = math.ceil(len(shown) / columns)
    figure, axes = plt.subplots(
        rows,
        columns,
        figsize=(3.4 * columns + 2.4, 3.2 * rows + 0.6),
        squeeze=False,
        sharey=True,
        layout="constrained",
    )
    widths = result["widths"]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, t in zip(axes.flat, shown, strict=False):
        column = result["steps"].index(t)
        for index, (group, table) in enumerate(result["scales"].items()):
            ys = [row[column] for row in table]
            draw(ax, widths, ys, group, color=colors[index % len(colors)])
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.xaxis.set_major_locator(ticker.FixedLocator(widths))
        ax.xaxis.set_major_formatter(ticker.FixedFormatter([str(w) for w in widths]))
        ax.xaxis.set_minor_locator(ticker.NullLocator())
        ax.set_title(f"t = {t}")
        ax.set_xlabel("width (d_model)")
        ax.grid(True, which="major", alpha=0.3)
    for ax in axes[:, 0]:
        ax.set_ylabel("mean |x|")
    for ax in list(axes.flat)[len(shown) :]:
        ax.set_visible(False)
    handles, labels = axes.flat[0].get_legend_handles_labels()
    figure.legend(handles, labels, loc="outside right center", fontsize="small")
    figure.suptitle(title_of(result))
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def scale_table(result: dict, step: int | None = None) -> str:
    """``mean |x|`` of each group (a row) at each width (a column) at ``step`` (default: the
    last), and the ratio of the widest's to the narrowest's; the loss last."""
    column = result["steps"].index(result["steps"][-1] if step is None else step)
    widths = result["widths"]
    rows = {group: [row[column] for row in table] for group, table in result["scales"].items()}
    rows["loss"] = [row[column] for row in result["loss"]]
    first = max(map(len, rows))
    header = [f"{'t = ' + str(result['steps'][column]):<{first}}"]
    header += [f"{w:>9}" for w in widths] + [f"{f'x{widths[-1]}/{widths[0]}':>10}"]
    lines = [
        f"mean |x| of each module's output on the fixed batch after {result['steps'][column]} "
        f"step(s), by width (d_model), over the layers and {result['seeds']} seed(s); the "
        "batch's loss last",
        "  ".join(header),
    ]
    for group, values in rows.items():
        ratio = values[-1] / values[0] if values[0] else math.inf
        cells = [f"{group:<{first}}", *(f"{v:>9.3g}" for v in values), f"{ratio:>10.3g}"]
        lines.append("  ".join(cells))
    return "\n".join(lines)
