"""Several runs side by side, as after an ablation: their curves on one figure (any logged
metric, against steps and against tokens), their final metrics, and the settings in which their
configs differ (``flaxformer-lite compare``)."""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Sequence
from typing import Any

import yaml

from flaxformer_lite.train.config_keys import renamed_keys
from flaxformer_lite.train.figures import draw, log_scale_if_wide, pyplot, readable_ticks
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
        runs.append(Run(str(path), records, _settings(config)))
    return runs


def _settings(config: pathlib.Path) -> dict[str, Any]:
    """The run's resolved ``config.yaml`` as dotted keys; it must give the tokens of a step.

    Raises:
      ValueError: unreadable YAML, or not a run's config (no ``train.batch_size`` or
        ``data.seq_len``), in one line naming the file.
    """
    try:
        values = yaml.safe_load(config.read_text(encoding="utf-8"))
    except yaml.MarkedYAMLError as error:
        where = f" at line {error.problem_mark.line + 1}" if error.problem_mark else ""
        raise ValueError(f"{config}: not readable YAML ({error.problem}{where})") from None
    except (yaml.YAMLError, UnicodeDecodeError) as error:
        raise ValueError(f"{config}: not readable YAML ({error})") from None
    if not isinstance(values, dict):
        raise ValueError(f"{config}: not a run's resolved config (no mapping of settings)")
    settings = _flatten(renamed_keys(values, str(config)))
    missing = [k for k in ("train.batch_size", "data.seq_len") if not _count(settings.get(k))]
    if missing:
        raise ValueError(f"{config}: not a run's resolved config (no {' or '.join(missing)})")
    return settings


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


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
        for run in runs:
            for record in run.records:
                value = record.get(metric)
                if value is not None and (
                    isinstance(value, bool) or not isinstance(value, int | float)
                ):
                    raise ValueError(
                        f"--metric {metric}: {run.name} logged {value!r} at step "
                        f"{record.get('step')}, not a number"
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
    """Writes :func:`comparison_figure` to ``out`` (a PNG) and returns ``out``."""
    figure = comparison_figure(runs, metrics)
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=100)
    pyplot().close(figure)
    return out


def comparison_figure(runs: Sequence[Run], metrics: Sequence[str]):
    """One row of axes per metric, each titled with it: the runs' curves against steps (left)
    and against tokens (right), losses on a log scale where they span a decade, a run's single
    point a marker with its value; one legend above, a run in one colour throughout. A metric
    that some runs did not log says which in its panels."""
    from matplotlib.lines import Line2D

    plt = pyplot()
    figure, axes = plt.subplots(
        len(metrics), 2, figsize=(11, 3.6 * len(metrics) + 0.4), squeeze=False, layout="constrained"
    )
    colors = {run.name: f"C{i % 10}" for i, run in enumerate(runs)}
    for row, metric in zip(axes, metrics, strict=True):
        missing = []
        for run in runs:
            points = [(r["step"], r[metric]) for r in run.records if r.get(metric) is not None]
            if not points:
                missing.append(run.name)
                continue
            steps, values = zip(*points, strict=True)
            draw(row[0], steps, values, label=run.name, color=colors[run.name])
            tokens = [s * run.tokens_per_step for s in steps]
            draw(row[1], tokens, values, label=run.name, color=colors[run.name])
        x_labels = ("step", "tokens (steps x batch_size x seq_len)")
        for ax, x_label, by in zip(row, x_labels, ("step", "tokens"), strict=True):
            ax.set_title(f"{metric} by {by}")
            ax.set_xlabel(x_label)
            ax.set_ylabel(metric)
            if "loss" in metric:
                log_scale_if_wide(ax)
            readable_ticks(ax)
            if missing:
                ax.text(
                    0.5,
                    0.02,
                    f"not logged by {', '.join(missing)}",
                    transform=ax.transAxes,
                    ha="center",
                    va="bottom",
                    fontsize="small",
                    color="0.4",
                )
    handles = [Line2D([], [], color=c, marker="o", label=name) for name, c in colors.items()]
    figure.legend(handles=handles, loc="outside upper center", ncols=min(len(runs), 3))
    return figure


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
