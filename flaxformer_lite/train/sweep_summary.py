"""A sweep's numbers with their noise: each member's final metrics (the last value it logged of
each) and best eval loss, read from its ``metrics.jsonl``; for each group of members that differ
only in their seed, the mean and the sample standard deviation (``ddof=1``) over its n members;
the difference of two groups' means with its standard error.

    summary = summarize(pathlib.Path("runs/seeds"), members, diverged={})
    print(summary_table(summary))
    difference(summary["groups"]["lr=1e-3"], summary["groups"]["lr=3e-3"], "eval_loss")
"""

from __future__ import annotations

import math
import pathlib
import statistics
from collections.abc import Sequence

from flaxformer_lite.evals.tasks import headline_metrics, is_count
from flaxformer_lite.train.compare import format_table
from flaxformer_lite.train.metrics import read_metrics
from flaxformer_lite.train.sweep_dir import SweepDir
from flaxformer_lite.train.sweep_members import Member, group_of

BEST = "best_eval_loss"  # the lowest eval_loss a member logged
# The table's columns when logged, and each downstream task's headline metric; sweep.json has
# every metric.
TABLE_METRICS = ("loss", "eval_loss", BEST, "eval_accuracy", "eval_exact_match")
# Throughput is the program's, not a member's result: not summarized.
NOT_RESULTS = (
    "step",
    "learning_rate",
    "tokens_per_sec",
    "mfu",
    "eval_tokens",
    "eval_decoded_examples",
)


def is_result(metric: str) -> bool:
    """Whether a logged ``metric`` is a result to average over seeds: not a step, rate or count
    (a mixture's per-source ``eval_tokens/<name>`` is a count as ``eval_tokens`` is, and a
    task's ``task/<name>/examples``)."""
    return metric.split("/")[0] not in NOT_RESULTS and not is_count(metric)


def member_results(run_dir: pathlib.Path) -> dict[str, float]:
    """The last value of each metric the run logged, and :data:`BEST`; ``step``: its last
    logged step."""
    records = read_metrics(run_dir, log=lambda _: None)
    results: dict[str, float] = {}
    for record in records:
        results.update({k: v for k, v in record.items() if isinstance(v, int | float)})
    losses = [r["eval_loss"] for r in records if isinstance(r.get("eval_loss"), int | float)]
    if losses:
        results[BEST] = min(losses)
    return results


def summarize(directory: pathlib.Path, members: Sequence[Member], diverged: dict) -> dict:
    """``{"members": {name: ...}, "groups": {group: {metric: {mean, std, n}, "members": [...],
    "diverged": [...]}}}``; a diverged member is listed in its group, not counted in it."""
    summary: dict = {"members": {}, "groups": {}}
    for member in members:
        run = SweepDir(directory).member(member.name)
        results = member_results(run.path) if run.metrics.exists() else {}
        group = group_of(member)
        summary["members"][member.name] = {
            "group": group,
            "settings": {k: _plain(v) for k, v in member.settings.items()},
            "results": results,
            "diverged_at": diverged.get(member.name),
        }
        entry = summary["groups"].setdefault(group, {"members": [], "diverged": []})
        entry["diverged" if member.name in diverged else "members"].append(member.name)
    for group in summary["groups"].values():
        counted = [summary["members"][name]["results"] for name in group["members"]]
        metrics = sorted(k for k in {k for r in counted for k in r} if is_result(k))
        for metric in metrics:
            values = [results[metric] for results in counted if metric in results]
            group[metric] = mean_std(values)
    return summary


def mean_std(values: Sequence[float]) -> dict:
    """``{"mean", "std", "n"}``: the sample standard deviation (None for one value)."""
    n = len(values)
    return {
        "mean": statistics.fmean(values),
        "std": statistics.stdev(values) if n > 1 else None,
        "n": n,
    }


def difference(a: dict, b: dict, metric: str) -> dict:
    """``b``'s mean of ``metric`` minus ``a``'s, its standard error ``sqrt(s_a^2/n_a +
    s_b^2/n_b)`` and whether it is within noise (under two standard errors); the error is None
    when a group has one member (no spread to go by).

    Raises:
      KeyError: a group that has no value of ``metric``.
    """
    x, y = a[metric], b[metric]
    diff = y["mean"] - x["mean"]
    if x["std"] is None or y["std"] is None:
        return {"difference": diff, "stderr": None, "within_noise": None}
    stderr = math.sqrt(x["std"] ** 2 / x["n"] + y["std"] ** 2 / y["n"])
    return {"difference": diff, "stderr": stderr, "within_noise": abs(diff) < 2 * stderr}


def read_summary(directory: pathlib.Path) -> dict:
    """The summary of the sweep in ``directory``: the one it wrote at its end, or, for a sweep
    still training or stopped, one made now from what its members have logged.

    Raises:
      ValueError: ``directory/sweep.json`` is not a sweep's record."""
    sweep_dir = SweepDir(directory)
    record = sweep_dir.read()
    try:
        if "summary" in record:
            summary = record["summary"]
        else:
            members = [Member(n, settings, None) for n, settings in record["members"].items()]
            summary = summarize(directory, members, record.get("diverged", {}))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise ValueError(f"{sweep_dir.record}: not a sweep's record ({error})") from None
    _check_summary(summary, sweep_dir.record)
    return summary


def _check_summary(summary, where: pathlib.Path) -> None:
    """Raises ValueError naming the first entry of ``summary`` that is not of its shape: groups
    and members by name, each group's metrics a mean, a deviation (or None) and a count."""
    if not isinstance(summary, dict) or not all(
        isinstance(summary.get(key), dict) for key in ("groups", "members")
    ):
        raise ValueError(f"{where}: its summary is not a sweep's (groups and members by name)")
    for name, group in summary["groups"].items():
        if not isinstance(group, dict) or not isinstance(group.get("members"), list):
            raise ValueError(f"{where}: group {name!r} is not a sweep's group ({group!r})")
        for metric, stats in group.items():
            if metric not in ("members", "diverged") and not _is_stats(stats):
                raise ValueError(
                    f"{where}: group {name!r}, {metric}: not a mean, a deviation and a count "
                    f"({stats!r})"
                )


def _is_stats(stats) -> bool:
    def number(x) -> bool:
        return isinstance(x, int | float) and not isinstance(x, bool)

    return (
        isinstance(stats, dict)
        and number(stats.get("mean"))
        and (stats.get("std") is None or number(stats["std"]))
        and isinstance(stats.get("n"), int)
        and not isinstance(stats["n"], bool)
        and stats["n"] >= 1
    )


def split_group(path: pathlib.Path | str) -> tuple[pathlib.Path, str | None] | None:
    """``(DIR, None)`` for a sweep ``DIR`` (holding ``sweep.json``), ``(DIR, GROUP)`` for
    ``DIR:GROUP``, or ``None``: not a sweep. A group's name may hold colons (an import path)."""
    text = str(path)
    if SweepDir(text).is_sweep():
        return pathlib.Path(text), None
    for i, char in enumerate(text):
        if char == ":" and SweepDir(text[:i]).is_sweep():
            return pathlib.Path(text[:i]), text[i + 1 :]
    return None


def is_sweep(path: pathlib.Path) -> bool:
    """Whether ``path`` names a sweep (``DIR`` holding ``sweep.json``) or one of its groups
    (``DIR:GROUP``)."""
    return split_group(path) is not None


def sweep_groups(path: pathlib.Path) -> dict[str, dict]:
    """The groups ``path`` names: every group of the sweep ``DIR``, or ``DIR:GROUP``'s one, by
    label (``DIR:GROUP``).

    Raises:
      ValueError: no finished sweep there, or no such group (naming those there are)."""
    text = str(path)
    directory, group = split_group(path) or (pathlib.Path(text), None)
    groups = read_summary(directory)["groups"]
    if group is None:
        return {f"{directory}:{name}": values for name, values in groups.items()}
    if group not in groups:
        raise ValueError(f"{directory} has no group {group!r}; its groups: {', '.join(groups)}")
    return {text: groups[group]}


def compare_groups(a: dict[str, dict], b: dict[str, dict]) -> list[tuple[str, str]]:
    """The pairs of group labels to compare: the one of each side, or, for two whole sweeps,
    the groups of the same name.

    Raises:
      ValueError: several groups on a side that the other side's names do not match."""
    if len(a) == 1 and len(b) == 1:
        return [(next(iter(a)), next(iter(b)))]
    names_a = {split_group(label)[1]: label for label in a}
    names_b = {split_group(label)[1]: label for label in b}
    if names_a.keys() != names_b.keys():
        raise ValueError(
            f"the sides hold groups {sorted(names_a)} and {sorted(names_b)}: name one group of "
            "each as DIR:GROUP, or compare sweeps with the same groups"
        )
    return [(names_a[name], names_b[name]) for name in names_a]


def summary_table(summary: dict) -> str:
    """The groups' metrics as ``mean ± std (n)``, one row a group."""
    groups = summary["groups"]
    logged = {key for group in groups.values() for key in group}
    metrics = [m for m in TABLE_METRICS if m in logged] + headline_metrics(sorted(logged))
    rows = []
    for name, group in groups.items():
        cells = [_spread(group.get(metric)) for metric in metrics]
        note = f" ({len(group['diverged'])} diverged)" if group["diverged"] else ""
        rows.append([name + note, *cells])
    return format_table(["group (mean ± std over seeds, n)", *metrics], rows)


def difference_text(metric: str, diff: dict) -> str:
    """One line: the difference, its standard error, and what it means."""
    if not math.isfinite(diff["difference"]) or not math.isfinite(diff["stderr"] or 0.0):
        return f"{metric}: difference {diff['difference']:+.4g}: a mean is not finite, no verdict"
    if diff["stderr"] is None:
        return f"{metric}: difference {diff['difference']:+.4g} (one member: no error bar)"
    if diff["stderr"] == 0:  # a score of few examples: every seed gave the same one
        return (
            f"{metric}: difference {diff['difference']:+.4g} ± 0: each group's members all logged "
            "the same value, no spread to judge it against"
        )
    verdict = (
        "within noise (under 2 standard errors)"
        if diff["within_noise"]
        else f"{abs(diff['difference']) / diff['stderr']:.1f} standard errors: beyond noise"
    )
    return (
        f"{metric}: difference {diff['difference']:+.4g} ± {diff['stderr']:.2g} "
        f"(standard error): {verdict}"
    )


def _spread(stats: dict | None) -> str:
    if stats is None:
        return "-"
    if stats["std"] is None:
        return f"{stats['mean']:.4g} (n=1)"
    return f"{stats['mean']:.4g} ± {stats['std']:.2g} ({stats['n']})"


def _plain(value):
    return value if isinstance(value, str | int | float | bool) or value is None else str(value)
