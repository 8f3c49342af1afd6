"""A sweep's curves: for each seed group, the mean over its members of each metric at every
step they all logged, with a band of one standard deviation (``ddof=1``) around it, against
steps and against tokens.

    plot_sweep(pathlib.Path("runs/seeds"))  # runs/seeds/plots/sweep.png
"""

from __future__ import annotations

import pathlib

import numpy as np

from flaxformer_lite.train.compare import load_runs
from flaxformer_lite.train.figures import log_scale_if_wide, pyplot, readable_ticks
from flaxformer_lite.train.metrics import read_metrics
from flaxformer_lite.train.run_dir import RunDir
from flaxformer_lite.train.sweep_dir import SweepDir
from flaxformer_lite.train.sweep_summary import read_summary

CURVES = ("loss", "eval_loss", "eval_accuracy", "eval_exact_match")


def group_curve(records: list[list[dict]], metric: str):
    """``(steps, mean, std)`` of ``metric`` over the members' records, at the steps where every
    member logged it; ``std`` is 0 for a group of one."""
    by_member = [{r["step"]: r[metric] for r in rs if r.get(metric) is not None} for rs in records]
    steps = sorted(set.intersection(*(set(values) for values in by_member)))
    table = np.asarray([[values[step] for step in steps] for values in by_member], np.float64)
    spread = table.std(axis=0, ddof=1) if len(by_member) > 1 else np.zeros(len(steps))
    return np.asarray(steps), table.mean(axis=0), spread


def unlogged_members(directory: pathlib.Path) -> list[str]:
    """The members of the sweep in ``directory`` that have logged no step yet (a sweep stopped
    before their program, or still compiling it)."""
    sweep_dir = SweepDir(directory)
    return [
        name
        for name in sweep_dir.read()["members"]
        if not any("step" in record for record in _records(sweep_dir.member(name).path))
    ]


def _records(run_dir: pathlib.Path) -> list[dict]:
    if not RunDir(run_dir).metrics.is_file():
        return []
    return read_metrics(run_dir, log=lambda _: None)


def plot_sweep(directory: pathlib.Path) -> list[pathlib.Path]:
    """Writes ``directory/plots/sweep.png`` (a row per metric: by step, by tokens) of the
    members that have logged (:func:`unlogged_members` are left out); returns ``[path]``, or
    ``[]`` when no member has logged a step yet.

    Raises:
      ValueError: ``directory/sweep.json`` is not a sweep's record (:func:`.read_summary`).
      RunDirLinkError: the sweep's directory holds symbolic links (nothing is written).
    """
    sweep_dir = SweepDir(directory)
    RunDir(directory).refuse_links()
    groups = read_summary(directory)["groups"]
    waiting = set(unlogged_members(directory))
    runs = {
        name: load_runs([sweep_dir.member(m).path for m in group["members"] if m not in waiting])
        for name, group in groups.items()
        if set(group["members"]) - waiting
    }
    plots = sweep_dir.plots
    written = plot_groups(runs, plots / "sweep.png")
    return [] if written is None else [written]


def plot_groups(runs: dict[str, list], path: pathlib.Path) -> pathlib.Path | None:
    """Draws each group's mean curve ± one standard deviation over its runs (``compare.Run``s)
    of every metric of :data:`CURVES` logged, by step and by tokens, into ``path`` (a PNG);
    None when nothing was logged."""
    logged = {k for group in runs.values() for run in group for r in run.records for k in r}
    metrics = [metric for metric in CURVES if metric in logged]
    if not metrics:
        return None
    plt = pyplot()
    figure, axes = plt.subplots(
        len(metrics), 2, figsize=(11, 3.6 * len(metrics) + 0.4), squeeze=False, layout="constrained"
    )
    for row, metric in zip(axes, metrics, strict=True):
        for index, (name, members) in enumerate(runs.items()):
            steps, mean, std = group_curve([run.records for run in members], metric)
            if not len(steps):
                continue
            label = f"{name} (n={len(members)})"
            for ax, xs in zip(row, (steps, steps * members[0].tokens_per_step), strict=True):
                ax.plot(
                    xs,
                    mean,
                    color=f"C{index % 10}",
                    label=label,
                    marker="." if len(xs) < 3 else None,
                )
                ax.fill_between(xs, mean - std, mean + std, color=f"C{index % 10}", alpha=0.2)
        for ax, by in zip(row, ("step", "tokens (steps x batch_size x seq_len)"), strict=True):
            ax.set_title(f"{metric}: mean ± std over seeds, by {by.split()[0]}")
            ax.set_xlabel(by)
            ax.set_ylabel(metric)
            if "loss" in metric:
                log_scale_if_wide(ax)
            readable_ticks(ax)
    handles, labels = axes[0][0].get_legend_handles_labels()
    figure.legend(handles, labels, loc="outside upper center", ncols=min(len(labels), 3))
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path
