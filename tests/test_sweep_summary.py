"""A sweep's groups and summary, without training: which members share a compiled step,
the mean and standard deviation of a group, the difference of two groups and its verdict, and
which logged numbers are results. (Sweeps trained: test_sweep.py.)"""

import statistics

import pytest
from tiny_runs import TINY

from flaxformer_lite.train import sweep as sweep_module
from flaxformer_lite.train import sweep_summary
from flaxformer_lite.train.config import load_config
from flaxformer_lite.train.sweep_members import split_settings, sweep_members
from flaxformer_lite.train.sweep_summary import difference, mean_std


def test_groups_without_spread_get_no_verdict():
    """Two groups whose members each logged one value (a task scored on few examples): the
    difference is said, with no verdict of noise (their standard error is 0)."""
    a, b = mean_std([0.4, 0.4]), mean_std([0.6, 0.6])
    line = sweep_summary.difference_text("task/x/acc", difference({"m": a}, {"m": b}, "m"))
    assert line == (
        "task/x/acc: difference +0.2 ± 0: each group's members all logged the same value, no "
        "spread to judge it against"
    )


def test_the_difference_of_two_groups_has_its_standard_error():
    a, b = mean_std([1.0, 2.0, 3.0]), mean_std([3.0, 4.0, 5.0, 6.0])
    assert a == {"mean": 2.0, "std": 1.0, "n": 3}
    diff = difference({"x": a}, {"x": b}, "x")
    stderr = (1.0 / 3 + statistics.variance([3.0, 4.0, 5.0, 6.0]) / 4) ** 0.5
    assert diff["difference"] == 2.5 and diff["stderr"] == pytest.approx(stderr)
    assert diff["within_noise"] is False  # 2.5 > 2 * 0.866
    close = difference({"x": a}, {"x": mean_std([2.5, 1.5, 3.5])}, "x")
    assert close["within_noise"] is True
    single = difference({"x": mean_std([1.0])}, {"x": b}, "x")
    assert single["stderr"] is None and single["within_noise"] is None


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
