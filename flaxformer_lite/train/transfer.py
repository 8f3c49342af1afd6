"""A hyperparameter transfer check from a sweep: a metric against one varied setting (the
learning rate), a curve per value of another (the width), each point the mean over the seeds
with one standard deviation (``ddof=1``), and the best value of the setting for each curve.
Under muP the best learning rate of a narrow model should be that of a wide one.

    flaxformer-lite sweep --config shakespeare_char --vary model.d_model=64,128,256 \\
        --vary optimizer.lr=1e-3,3e-3,1e-2 --vary seed=0,1 run_dir=runs/mup \\
        model.parametrization=mup model.mup_base_width=64 model.d_ff=null
    table = transfer_table([pathlib.Path("runs/mup")])  # then plot_transfer(...)
"""

from __future__ import annotations

import math
import pathlib

from flaxformer_lite.train.compare import format_table
from flaxformer_lite.train.figures import pyplot, readable_ticks
from flaxformer_lite.train.run_dir import RunDir
from flaxformer_lite.train.sweep_dir import SweepDir
from flaxformer_lite.train.sweep_summary import read_summary


def transfer_table(
    directories: list[pathlib.Path],
    *,
    x: str = "optimizer.lr",
    curves: str = "model.d_model",
    metric: str = "eval_loss",
) -> dict:
    """``{curve value: {"points": [(x, mean, std, n), ...] by x, "best": (x, mean, std, n)}}``
    of the sweeps in ``directories`` (one, or several that ran apart, say a width each), from
    their groups' means over seeds (the lowest mean is best; a group whose members all diverged
    has no point).

    Raises:
      ValueError: ``x`` or ``curves`` not among a sweep's varied settings, a group without
        ``metric``, or one point in two sweeps.
    """
    table: dict = {}
    for directory in directories:
        record = SweepDir(directory).read()
        varied = record.get("vary", {})
        for key in (x, curves):
            if key not in varied:
                raise ValueError(
                    f"{directory} does not vary {key}; it varies {', '.join(varied) or 'nothing'}"
                )
        for name, group in read_summary(directory)["groups"].items():
            if not group["members"]:
                continue
            if metric not in group:
                raise ValueError(f"group {name} of {directory} has no {metric} logged")
            settings = record["members"][group["members"][0]]
            stats = group[metric]
            point = (float(settings[x]), stats["mean"], stats["std"] or 0.0, stats["n"])
            points = table.setdefault(_number(settings[curves]), {"points": []})["points"]
            if any(other[0] == point[0] for other in points):
                raise ValueError(
                    f"{curves}={settings[curves]}, {x}={settings[x]} is in two of the sweeps"
                )
            points.append(point)
    for entry in table.values():
        entry["points"].sort()
        entry["best"] = min(entry["points"], key=lambda point: point[1])
    return dict(sorted(table.items()))


def best_table(table: dict, *, x: str, curves: str, metric: str) -> str:
    """The best ``x`` of each curve, its mean ± std and how many seeds, as text."""
    rows = [
        [str(curve), f"{best[0]:g}", f"{best[1]:.4f} ± {best[2]:.4f}", str(best[3])]
        for curve, entry in table.items()
        for best in [entry["best"]]
    ]
    return format_table([curves, f"best {x}", f"{metric} (mean ± std)", "seeds"], rows)


def plot_transfer(
    directory: pathlib.Path, table: dict, *, x: str, curves: str, metric: str
) -> pathlib.Path:
    """Draws ``directory/plots/transfer.png``: ``metric`` against ``x`` (log axis), a curve per
    value of ``curves`` with error bars of one standard deviation, its best point marked.

    Raises:
      RunDirLinkError: the sweep's directory holds symbolic links (nothing is written).
    """
    RunDir(directory).refuse_links()  # the figure's write would follow them out of it
    plt = pyplot()
    figure, ax = plt.subplots(figsize=(7, 4.5), layout="constrained")
    for index, (curve, entry) in enumerate(table.items()):
        xs, means, stds, _ = zip(*entry["points"], strict=True)
        color = f"C{index % 10}"
        ax.errorbar(xs, means, yerr=stds, color=color, marker="o", capsize=3, label=f"{curve}")
        ax.plot(*entry["best"][:2], marker="*", markersize=14, color=color)
    ax.set_xscale("log")
    ax.set_xlabel(x)
    ax.set_ylabel(f"{metric} (mean ± std over seeds)")
    ax.set_title(f"{SweepDir(directory).path.name}: {metric} by {x}, one curve per {curves}")
    ax.legend(title=curves)
    readable_ticks(ax)
    plots = SweepDir(directory).plots
    plots.mkdir(exist_ok=True)
    path = plots / "transfer.png"
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def _number(text: str):
    """A varied value as a number when it is one (widths sort as numbers), else as given."""
    try:
        value = float(text)
    except (TypeError, ValueError):
        return text
    return int(value) if math.isfinite(value) and value == int(value) else value
