"""What the figures of runs share (``plot``'s PNGs of one run, ``compare``'s grid of several): a
series with few points marks each point (a line through one point draws nothing: the eval of a
short run), and large numbers on an axis read as ``400k``, ``1.2M`` (in full they run together).
"""

from __future__ import annotations

import math

# Series of at most this many points (evaluations, short runs) mark each point.
MARKED_POINTS = 30
# Ticks from this magnitude on are written with an SI prefix (12k, 1.2M).
LARGE = 1e4


def pyplot():
    """matplotlib's pyplot, drawing to files (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    return plt


def draw(ax, xs, ys, label: str, color=None, value_in_legend: bool = False) -> None:
    """``ys`` against ``xs`` on ``ax`` (in ``color``, else the next of the axes' cycle): a line,
    with a marker at each point when there are few. A single point is a larger marker with its
    value beside it, or in its legend entry (``eval_loss = 1.207``): a curve would show it by its
    height among the others."""
    marker = "o" if len(xs) <= MARKED_POINTS else None
    value = None
    if len(xs) == 1:
        value = f"{ys[0]:,}" if isinstance(ys[0], int) else f"{ys[0]:.4g}"
        label = f"{label} = {value}" if value_in_legend else label
    size = 7 if len(xs) == 1 else 4
    (line,) = ax.plot(xs, ys, label=label, color=color, marker=marker, markersize=size)
    if value is not None and not value_in_legend:
        ax.annotate(
            value,
            (xs[0], ys[0]),
            xytext=(6, 0),
            textcoords="offset points",
            va="center",
            fontsize="small",
            color=line.get_color(),
        )


def log_scale_if_wide(ax) -> None:
    """A log y axis where the drawn values are positive and span a decade or more (a loss that
    falls from 5 to 0.01); else the linear one, which reads better over a narrow range. An
    infinite value (a diverged step) is not drawn, and spans nothing."""
    values = [v for line in ax.lines for v in line.get_ydata() if math.isfinite(v)]
    if values and min(values) > 0 and max(values) >= 10 * min(values):
        ax.set_yscale("log")


def readable_ticks(ax) -> None:
    """At most six ticks an axis, whole numbers on x (steps, tokens), large values with an SI
    prefix, a log axis in decimals; call after the scales are set."""
    from matplotlib import ticker

    for axis, limits, whole in ((ax.xaxis, ax.get_xlim(), True), (ax.yaxis, ax.get_ylim(), False)):
        if axis.get_scale() == "log":  # decades as 0.01 and 1, not 10^-2 and 10^0
            axis.set_major_formatter(ticker.FuncFormatter(lambda value, _: f"{value:g}"))
            axis.set_minor_formatter(ticker.NullFormatter())
            continue
        axis.set_major_locator(ticker.MaxNLocator(nbins=6, steps=[1, 2, 2.5, 5, 10], integer=whole))
        if max(map(abs, limits)) >= LARGE:
            axis.set_major_formatter(ticker.EngFormatter(sep=""))


def tokens_axis(ax, tokens_per_step: int, label: str | None = None) -> None:
    """A second x axis on top of a step axis: the tokens trained by then (``tokens_per_step`` a
    step), with SI tick labels; ``label`` or :func:`tokens_label`."""
    from matplotlib import ticker

    top = ax.secondary_xaxis(
        "top", functions=(lambda s: s * tokens_per_step, lambda t: t / tokens_per_step)
    )
    top.set_xlabel(label or tokens_label(tokens_per_step))
    top.xaxis.set_major_locator(ticker.MaxNLocator(nbins=6))
    top.xaxis.set_major_formatter(ticker.EngFormatter(sep=""))


def tokens_label(tokens_per_step: int) -> str:
    return f"tokens ({tokens_per_step:,} a step: batch_size x seq_len)"
