"""Several runs side by side, as after an ablation: their curves on one figure (any logged
metric, against steps and against tokens), their final metrics, and the settings in which their
configs differ (``flaxformer-lite compare``)."""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Sequence
from typing import Any

import yaml

from flaxformer_lite.train.config import renamed_keys
from flaxformer_lite.train.metrics import read_metrics
from flaxformer_lite.train.run_dir import RunDir

DEFAULT_METRICS = ("loss", "eval_loss")


@dataclasses.dataclass(frozen=True)
class Run:
    """One run directory: its name in tables and legends, its logged records and its resolved
    config flattened to dotted keys."""

    name: str
    records: list[dict]
    settings: dict[str, Any]

    @property
    def tokens_per_step(self) -> int:
        """Token positions a step trains on: ``train.batch_size`` rows of ``data.seq_len``."""
        return self.settings["train.batch_size"] * self.settings["data.seq_len"]

    def final(self, metric: str):
        """The metric's last logged value, or None if it was never logged."""
        values = [r[metric] for r in self.records if r.get(metric) is not None]
        return values[-1] if values else None


def load_runs(paths: Sequence[pathlib.Path | str]) -> list[Run]:
    """The runs of ``paths`` (named as given).

    Raises:
      FileNotFoundError: a directory without ``metrics.jsonl`` or ``config.yaml``.
      ValueError: a run that has logged no step yet.
    """
    runs = []
    for path in map(pathlib.Path, paths):
        records = read_metrics(path)
        if not any("step" in record for record in records):
            raise ValueError(f"{RunDir(path).metrics}: no metrics logged yet")
        config = RunDir(path).config
        if not config.exists():
            raise FileNotFoundError(f"{config}: no resolved config (is {path} a run directory?)")
        settings = renamed_keys(yaml.safe_load(config.read_text()), str(config))
        runs.append(Run(str(path), records, _flatten(settings)))
    return runs


def logged_metrics(runs: Sequence[Run]) -> list[str]:
    """Every metric any of ``runs`` logged, in the order first seen."""
    names = {}
    for run in runs:
        for record in run.records:
            names |= dict.fromkeys(key for key in record if key != "step")
    return list(names)


def check_metrics(runs: Sequence[Run], metrics: Sequence[str]) -> None:
    """Raises ``ValueError`` naming a metric that no run logged, and the ones they did."""
    logged = logged_metrics(runs)
    for metric in metrics:
        if metric not in logged:
            raise ValueError(
                f"--metric {metric}: no run logged it; logged metrics: {', '.join(logged)}"
            )


def final_metrics_table(runs: Sequence[Run]) -> str:
    """Each metric's last logged value per run (``-``: never logged), and the last step."""
    rows = [["step", *(max(r["step"] for r in run.records) for run in runs)]]
    rows += [[metric, *(run.final(metric) for run in runs)] for metric in logged_metrics(runs)]
    return format_table(["final metrics", *(run.name for run in runs)], rows)


def differing_settings(runs: Sequence[Run]) -> dict[str, list]:
    """``{dotted key: [value per run]}`` for every setting (but ``run_dir``) not equal in all."""
    keys = dict.fromkeys(key for run in runs for key in run.settings)
    differing = {}
    for key in keys:
        values = [run.settings.get(key) for run in runs]
        if key != "run_dir" and any(value != values[0] for value in values):
            differing[key] = values
    return differing


def settings_table(runs: Sequence[Run]) -> str:
    differing = differing_settings(runs)
    if not differing:
        return "the runs' settings are the same (but run_dir)"
    rows = [[key, *values] for key, values in differing.items()]
    return format_table(["settings that differ", *(run.name for run in runs)], rows)


def format_table(header: Sequence[str], rows: Sequence[Sequence]) -> str:
    """A plain-text table, columns aligned; floats to 4 significant digits, None as ``-``."""
    cells = [list(header)] + [[_cell(value) for value in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True))
        for row in cells
    ]
    return "\n".join(line.rstrip() for line in lines)


def plot_comparison(runs: Sequence[Run], metrics: Sequence[str], out: pathlib.Path) -> pathlib.Path:
    """One row of axes per metric: the runs' curves against steps (left) and against tokens
    (right); losses on a log scale. Returns ``out`` (a PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    figure, axes = plt.subplots(len(metrics), 2, figsize=(11, 3.6 * len(metrics)), squeeze=False)
    for row, metric in zip(axes, metrics, strict=True):
        for run in runs:
            points = [(r["step"], r[metric]) for r in run.records if r.get(metric) is not None]
            if not points:
                continue
            steps, values = zip(*points, strict=True)
            row[0].plot(steps, values, label=run.name)
            row[1].plot([s * run.tokens_per_step for s in steps], values, label=run.name)
        for ax, x_label in zip(row, ("step", "tokens (rows x seq_len)"), strict=True):
            ax.set_xlabel(x_label)
            ax.set_ylabel(metric)
            if "loss" in metric and ax.has_data():
                ax.set_yscale("log")
            if ax.has_data():
                ax.legend(fontsize="small")
    figure.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=100)
    plt.close(figure)
    return out


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _flatten(values: dict, prefix: str = "") -> dict[str, Any]:
    flat = {}
    for key, value in values.items():
        if isinstance(value, dict) and value:
            flat |= _flatten(value, f"{prefix}{key}.")
        else:
            flat[prefix + key] = value
    return flat
