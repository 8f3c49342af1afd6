"""A sweep's groups and summary, without training: which members share a compiled step,
the mean and standard deviation of a group, the difference of two groups and its test (against
scipy.stats: Welch's t, paired t over shared seeds), and
which logged numbers are results. (Sweeps trained: test_sweep.py.)"""

import math
import statistics

import pytest
from scipy import stats
from tiny_runs import TINY

from flaxformer_lite.train import sweep as sweep_module
from flaxformer_lite.train import sweep_summary
from flaxformer_lite.train.config import load_config
from flaxformer_lite.train.sweep_members import split_settings, sweep_members
from flaxformer_lite.train.sweep_summary import difference


def test_groups_without_spread_get_no_verdict():
    """Two groups whose members each logged one value (a task scored on few examples): the
    difference is said, with no verdict of noise."""
    diff = difference({0: 0.4, 1: 0.4}, {2: 0.6, 3: 0.6})
    line = sweep_summary.difference_text("task/x/acc", diff)
    assert line == (
        "task/x/acc: difference +0.2 ± 0: the members logged the same value, no spread to "
        "judge it against"
    )
    # Whatever the values' rounding (0.1 and 0.7 leave scipy a t of 1e32), and paired too.
    assert difference({0: 0.1, 1: 0.1, 2: 0.1}, {3: 0.7, 4: 0.7, 5: 0.7})["p"] is None
    paired = difference({0: 0.3, 1: 0.5}, {0: 0.6, 1: 0.8})
    assert paired["p"] is None and "the same difference on every seed" in (
        sweep_summary.difference_text("x", paired)
    )
    for bad in (math.inf, math.nan):  # an infinite perplexity: said, not a crash
        line = sweep_summary.difference_text("x", difference({0: bad, 1: 1.0}, {0: 2.0, 1: 3.0}))
        assert line.endswith("a mean is not finite, no verdict")


def test_unpaired_groups_get_welch_s_t_test_as_scipy_computes_it():
    a, b = {"a0": 1.0, "a1": 2.0, "a2": 3.0}, {"b0": 3.0, "b1": 4.0, "b2": 5.0, "b3": 6.5}
    diff = difference(a, b)
    welch = stats.ttest_ind(list(b.values()), list(a.values()), equal_var=False)
    low, high = welch.confidence_interval(0.95)
    assert diff["test"] == "Welch's t" and diff["n"] == (3, 4)
    assert diff["difference"] == pytest.approx(4.625 - 2.0)
    assert diff["p"] == pytest.approx(welch.pvalue) and diff["df"] == pytest.approx(welch.df)
    assert diff["ci"] == pytest.approx((low, high))
    stderr = (statistics.variance(a.values()) / 3 + statistics.variance(b.values()) / 4) ** 0.5
    assert diff["stderr"] == pytest.approx(stderr)
    assert diff["within_noise"] == (welch.pvalue >= 0.05)
    line = sweep_summary.difference_text("eval_loss", diff)
    assert line == (
        f"eval_loss: difference +2.625, 95% CI [{low:+.3g}, {high:+.3g}], p = {welch.pvalue:.2g} "
        f"(Welch's t, df {welch.df:.3g}): {'within' if welch.pvalue >= 0.05 else 'beyond'} "
        "noise at the 5% level"
    )


def test_two_seeds_a_side_at_3_standard_errors_are_within_noise():
    """The issue's case: 2 seeds per arm, the difference 3.1 standard errors, which the old
    rule (2 standard errors) called beyond noise; Welch's t with its ~2 degrees of freedom."""
    diff = difference({0: 1.50, 1: 1.52}, {2: 1.44, 3: 1.46})
    assert diff["difference"] / diff["stderr"] < -3 and diff["p"] > 0.05
    assert diff["within_noise"] is True


def test_groups_trained_on_the_same_seeds_are_paired():
    """Per-seed differences far tighter than the spread across seeds: the paired test sees
    them; Welch's would not."""
    a = {0: 1.470, 1: 1.500, 2: 1.530}
    b = {0: 1.4634, 1: 1.4918, 2: 1.5229}
    diff = difference(a, b)
    paired = stats.ttest_rel([b[s] for s in (0, 1, 2)], [a[s] for s in (0, 1, 2)])
    assert diff["test"] == "paired t over 3 shared seeds" and diff["df"] == 2
    assert diff["p"] == pytest.approx(paired.pvalue) and diff["within_noise"] is False
    assert diff["ci"] == pytest.approx(tuple(paired.confidence_interval(0.95)))
    assert difference({0: 1.470, 1: 1.500, 2: 1.530}, {3: 1.4634, 4: 1.4918, 5: 1.5229})[
        "within_noise"
    ]  # the same numbers on other seeds: Welch's, within noise


def test_the_training_loss_and_one_member_groups_get_no_verdict():
    diff = difference({0: 2.0, 1: 2.2}, {0: 1.5, 1: 1.6})
    line = sweep_summary.difference_text("loss", diff)
    assert line.startswith("loss: difference -0.55 ± ") and "no held-out measure" in line
    assert "noise" not in line
    single = difference({0: 1.0}, {1: 2.0, 2: 3.0})
    assert single["test"] is None and single["within_noise"] is None
    assert "no error bar, no test" in sweep_summary.difference_text("eval_loss", single)


@pytest.mark.parametrize(
    ("vary", "programs"),
    [
        # Numbers of the step: one program.
        ({"optimizer.schedule": ["cosine", "linear"], "optimizer.b1": ["0.8", "0.9"]}, [4]),
        ({"optimizer.clip_norm": ["1.0", "2.0"], "train.z_loss": ["0", "1e-4"]}, [4]),
        # Settings the traced step does not see: one program.
        ({"model.init_std": ["0.02", "0.05"]}, [2]),
        # The graph or the shapes: a program each.
        ({"model.num_decoder_layers": ["1", "2"], "seed": ["0", "1"]}, [2, 2]),
        # Dropout rates of the embedding and the residual branches are numbers too...
        (
            {"model.residual_dropout": ["0.1", "0.2"], "model.embedding_dropout": ["0.1", "0.3"]},
            [4],
        ),
        # ...but dropout on or off is the graph, and attention dropout's rate a constant.
        ({"model.residual_dropout": ["0", "0.2"]}, [1, 1]),
        ({"model.attention_dropout": ["0.1", "0.2"]}, [1, 1]),
        ({"optimizer.clip_norm": ["1.0", "null"]}, [1, 1]),
    ],
)
def test_members_share_a_program_exactly_when_their_steps_are_the_same(vary, programs):
    cfg = load_config(None, [*TINY, "run_dir=unused"])
    groups = sweep_module._groups(sweep_members(cfg, vary))
    assert [len(group) for group in groups] == programs
    if len(programs) > 1:
        assert split_settings(sweep_members(cfg, vary), groups) == [next(iter(vary))]


def test_counts_and_rates_are_not_averaged_as_results():
    from flaxformer_lite.train.sweep_summary import is_result

    assert is_result("eval_loss") and is_result("eval_loss/books")
    assert is_result("task/hellaswag/acc_norm")
    counts = ("eval_tokens", "eval_tokens/books", "eval_decoded_examples", "mfu", "step")
    for count in (*counts, "task/hellaswag/examples", "task/wiki/tokens"):
        assert not is_result(count), count


def test_member_names_are_the_command_line_s_and_fit_any_file_system():
    """Python floats read as the command line writes them (one sweep, one set of names, however
    started); an import path's colon, no file name's on every system, reads as a dot."""
    cfg = load_config(None, [*TINY, "run_dir=runs/s"])
    from_python = sweep_members(cfg, {"seed": [0, 1], "optimizer.lr": [1e-3, 2.5e-4, 0.5]})
    from_cli = sweep_members(cfg, {"seed": ["0", "1"], "optimizer.lr": ["1e-3", "2.5e-4", "0.5"]})
    assert [m.name for m in from_python] == [m.name for m in from_cli]
    assert from_python[0].name == "seed=0,lr=1e-3" and from_python[1].name == "seed=0,lr=2.5e-4"
    user = sweep_members(cfg, {"model.attention_implementation": ["xla", "mine:softmax_temp"]})
    assert [m.name for m in user] == [
        "attention_implementation=xla",
        "attention_implementation=mine.softmax_temp",
    ]
    assert user[1].cfg.model.attention_implementation == "mine:softmax_temp"
