"""A sweep's numbers with their noise: each member's final metrics (the last value it logged of
each) and best eval loss, read from its ``metrics.jsonl``; for each group of members that differ
only in their seed, the mean and the sample standard deviation (``ddof=1``) over its n members;
the difference of two groups' means (the second's minus the first's), tested: Welch's t, or a
paired t where the groups trained on the same seeds.

    summary = summarize(pathlib.Path("runs/seeds"), members, diverged={})
    print(summary_table(summary))
    groups, members = summary["groups"], summary["members"]
    a, b = (metric_values(groups[g], members, "eval_loss") for g in ("lr=1e-3", "lr=3e-3"))
    print(difference_text("eval_loss", difference(a, b)))  # lr=3e-3's minus lr=1e-3's
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


# The level of compare's test: a difference is "beyond noise" when p < LEVEL.
LEVEL = 0.05
# Metrics reported without a verdict, and why.
NO_VERDICT = {"loss": "the last step's one batch, no held-out measure: see eval_loss"}


def difference(a: dict, b: dict, *, level: float = LEVEL) -> dict:
    """``b``'s mean minus ``a``'s (``b - a``) of one metric, tested: ``a`` and ``b`` map each
    member's seed (or name) to its value. Members of both groups trained on the same seeds (2 or
    more) are paired: a paired t-test of the per-seed differences; otherwise Welch's t-test
    (unequal variances, Welch-Satterthwaite degrees of freedom). Returns ``{"difference",
    "stderr", "test", "df", "ci" (low, high at 1 - level), "p", "level", "within_noise"
    (p >= level), "n" (a's, b's)}``; the test's entries are None when a group has one member
    or no spread (a p that is not a number)."""
    import numpy as np
    from scipy import stats

    x, y = list(a.values()), list(b.values())
    diff = statistics.fmean(y) - statistics.fmean(x)
    result = {
        "difference": diff, "stderr": None, "test": None, "df": None, "ci": None, "p": None,
        "level": level, "within_noise": None, "n": (len(x), len(y)),
    }  # fmt: skip
    shared = sorted(a.keys() & b.keys(), key=str)
    paired = len(shared) >= 2 and len(shared) == len(a) == len(b)
    if not math.isfinite(diff) or (not paired and min(len(x), len(y)) < 2):
        return result
    if paired:
        differences = np.asarray([b[k] - a[k] for k in shared], np.float64)
        spread = float(differences.std(ddof=1)) / math.sqrt(len(shared))
        name = f"paired t over {len(shared)} shared seeds"
    else:
        variances = (np.var(v, ddof=1) / len(v) for v in (np.asarray(x), np.asarray(y)))
        spread = math.sqrt(sum(variances))
        name = "Welch's t"
    # No spread (every member, or every seed's difference, the same): no test to run; scipy's
    # statistic would be the rounding error's.
    if spread <= 1e-12 * max(abs(diff), *map(abs, x + y), 1e-300):
        return {**result, "stderr": 0.0, "test": name}
    with np.errstate(invalid="ignore", divide="ignore"):
        if paired:
            test = stats.ttest_rel([b[k] for k in shared], [a[k] for k in shared])
        else:
            test = stats.ttest_ind(y, x, equal_var=False)
        low, high = test.confidence_interval(1 - level)
    return {
        **result,
        "stderr": spread,
        "test": name,
        "df": float(test.df),
        "ci": (float(low), float(high)),
        "p": float(test.pvalue),
        "within_noise": bool(test.pvalue >= level),
    }


def metric_values(group: dict, members: dict, metric: str) -> dict:
    """A group's counted members' values of ``metric``, by seed where the sweep varied it (by
    member name otherwise): what :func:`difference` takes. ``members``: the summary's."""
    values = {}
    for name in group["members"]:
        results = members[name]["results"]
        if metric in results:
            values[members[name]["settings"].get("seed", name)] = results[metric]
    return values


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


def sweep_groups(path: pathlib.Path) -> dict[str, tuple[dict, dict]]:
    """The groups ``path`` names: every group of the sweep ``DIR``, or ``DIR:GROUP``'s one, by
    label (``DIR:GROUP``), each with the summary's members (``(group, members)``: what
    :func:`metric_values` reads).

    Raises:
      ValueError: no finished sweep there, or no such group (naming those there are)."""
    text = str(path)
    directory, group = split_group(path) or (pathlib.Path(text), None)
    summary = read_summary(directory)
    groups, members = summary["groups"], summary["members"]
    if group is None:
        return {f"{directory}:{name}": (values, members) for name, values in groups.items()}
    if group not in groups:
        raise ValueError(f"{directory} has no group {group!r}; its groups: {', '.join(groups)}")
    return {text: (groups[group], members)}


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
    """One line: the difference (``b - a``), then its confidence interval, the test and its p
    with the verdict at the test's level; a metric of :data:`NO_VERDICT` with its standard error
    and why it gets none."""
    value = f"{metric}: difference {diff['difference']:+.4g}"
    if not math.isfinite(diff["difference"]):
        return f"{value}: a mean is not finite, no verdict"
    if diff["test"] is None:
        return f"{value} (a group of one member: no error bar, no test)"
    if diff["p"] is None:  # a score of few examples: every seed gave the same one
        same = "difference on every seed" if diff["test"].startswith("paired") else "value"
        return f"{value} ± 0: the members logged the same {same}, no spread to judge it against"
    if metric in NO_VERDICT:
        return f"{value} ± {diff['stderr']:.2g} (standard error; {NO_VERDICT[metric]})"
    low, high = diff["ci"]
    verdict = "within noise" if diff["within_noise"] else "beyond noise"
    return (
        f"{value}, {1 - diff['level']:.0%} CI [{low:+.3g}, {high:+.3g}], p = {diff['p']:.2g} "
        f"({diff['test']}, df {diff['df']:.3g}): {verdict} at the {diff['level']:.0%} level"
    )


def _spread(stats: dict | None) -> str:
    if stats is None:
        return "-"
    if stats["std"] is None:
        return f"{stats['mean']:.4g} (n=1)"
    return f"{stats['mean']:.4g} ± {stats['std']:.2g} ({stats['n']})"


def _plain(value):
    return value if isinstance(value, str | int | float | bool) or value is None else str(value)
