"""Sweeps (flaxformer_lite/train/sweep.py): members trained as one vmapped program equal their
solo runs; a diverging member stops alone; SIGTERM and the same command again continue
bit-exactly; 8 devices equal one; the summary's means and deviations are the members' own."""

import json
import os
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest
from subprocess_env import subprocess_env
from tiny_runs import TINY, task_files

from flaxformer_lite import load_run
from flaxformer_lite.cli import main
from flaxformer_lite.train import lanes
from flaxformer_lite.train import sweep as sweep_module
from flaxformer_lite.train.config import ConfigError, load_config
from flaxformer_lite.train.loop import Interrupted, run
from flaxformer_lite.train.metrics import read_metrics
from flaxformer_lite.train.run_dir import RunDir
from flaxformer_lite.train.sweep import sweep
from flaxformer_lite.train.sweep_dir import SweepDir
from flaxformer_lite.train.sweep_members import sweep_members
from flaxformer_lite.train.sweep_plot import group_curve
from flaxformer_lite.train.sweep_summary import difference, metric_values, read_summary

pytestmark = pytest.mark.fast_compile

STEPS = 20
LONG_STEPS = 200  # the in-turn members against their runs
SETTINGS = [
    *TINY,
    f"train.steps={STEPS}",
    "data.train_size=2000",
    "train.log_every=5",
    "train.eval_every=10",
    "checkpoint.every=100",
    # Non-zero numbers that the members' step takes as arrays.
    "train.label_smoothing=0.1",
    "optimizer.weight_decay=0.1",
    "optimizer.b2=0.99",
]
VARY = {"seed": ["0", "1"], "optimizer.lr": ["1e-3", "3e-3"]}
MEMBERS = ["seed=0,lr=1e-3", "seed=0,lr=3e-3", "seed=1,lr=1e-3", "seed=1,lr=3e-3"]
COMPARED = (
    "loss",
    "accuracy",
    "grad_norm",
    "learning_rate",
    "eval_loss",
    "eval_accuracy",
    "task/sums/acc",
    "task/sums/acc_norm",
    "task/words/perplexity",
)


def numbers(run_dir):
    """Each logged record's results (not its throughput), by step."""
    return {
        r["step"]: {k: r[k] for k in COMPARED if k in r} for r in read_metrics(run_dir, log=None)
    }


def assert_close(a, b, rtol):
    assert a.keys() == b.keys()
    for step in a:
        assert a[step].keys() == b[step].keys(), step
        for key, value in a[step].items():
            np.testing.assert_allclose(value, b[step][key], rtol=rtol, err_msg=f"{key} {step}")


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    """Four members (two seeds x two learning rates), 20 steps, vmapped over the 8 simulated
    devices (on a CPU a sweep steps its members in turn unless told to vmap them)."""
    directory = tmp_path_factory.mktemp("sweep") / "s"
    tasks = task_files(directory.parent)  # each member scores them at its evaluations
    cfg = load_config(None, [*SETTINGS, *tasks, f"run_dir={directory}"])
    lines = []
    summary = sweep(cfg, VARY, vmap=True, log=lines.append)
    return directory, summary, lines


def test_the_members_are_runs_trained_as_one_program(swept):
    directory, summary, lines = swept
    assert sorted(p.name for p in directory.iterdir() if p.is_dir()) == ["plots", *MEMBERS]
    assert lines[-1] == f"wrote {directory / 'plots' / 'sweep.png'}"  # in place of a member's
    assert lines[0] == "sweep: 4 members, 1 compiled program (4 members)"
    # A member's tokens/s is its share of the step that advances all four: said so.
    logged = [line for line in lines if line.startswith(f"{MEMBERS[0]}: step 10/")]
    assert len(logged) == 1 and "k tokens/s (positions, this member's: the step's " in logged[0]
    assert "k over its 4 members)" in logged[0], logged
    assert any(
        line.startswith("compiled one step for 4 members, vmapped, on mesh member 4 x data 2")
        for line in lines
    )
    for name in MEMBERS:
        member = directory / name
        assert {"config.yaml", "metrics.jsonl", "checkpoints", "tokenizer", "tb"} <= {
            p.name for p in member.iterdir()
        }
        assert max(numbers(member)) == STEPS
    saved = json.loads((directory / "sweep.json").read_text())
    assert saved["summary"] == json.loads(json.dumps(summary))
    assert saved["diverged"] == {}


def test_a_member_trains_as_its_solo_run(swept, tmp_path):
    directory, _, _ = swept
    member = directory / "seed=1,lr=3e-3"
    run(load_config(member / "config.yaml", [f"run_dir={tmp_path / 'solo'}"]), progress=False)
    # The same arithmetic, vmapped and laid out over member x data instead of data alone.
    assert_close(numbers(member), numbers(tmp_path / "solo"), rtol=2e-4)


def test_each_member_stepped_in_turn_logs_exactly_what_its_own_run_logs(
    tmp_path, full_optimization
):
    """Four members (two seeds x two learning rates, cosine-decayed, with label smoothing, weight
    decay and Adam's b2 as numbers) for 200 steps on a CPU, stepped in turn, then each alone with
    ``train.py --config <member>/config.yaml``: the same program on the same numbers, so every
    logged number is equal, not close."""
    steps = [
        f"train.steps={LONG_STEPS}",
        "train.log_every=10",
        "train.eval_every=100",
        "optimizer.schedule=cosine",
    ]
    tasks = task_files(tmp_path)
    cfg = load_config(None, [*SETTINGS, *steps, *tasks, f"run_dir={tmp_path / 's'}"])
    sweep(cfg, VARY, vmap=False, log=lambda _: None)
    for name in MEMBERS:
        member = tmp_path / "s" / name
        solo = tmp_path / "solo" / name
        assert main(["train", "--config", str(member / "config.yaml"), f"run_dir={solo}"]) == 0
        logged = numbers(member)
        assert max(logged) == LONG_STEPS and sum("eval_loss" in r for r in logged.values()) == 2
        assert numbers(solo) == logged, name


def test_the_summary_is_the_mean_and_sample_deviation_of_the_members_metrics(swept):
    directory, summary, _ = swept
    for lr in ("1e-3", "3e-3"):
        group = summary["groups"][f"lr={lr}"]
        assert group["members"] == [f"seed=0,lr={lr}", f"seed=1,lr={lr}"]
        records = [read_metrics(directory / name, log=None) for name in group["members"]]
        last = [r[-1]["eval_loss"] for r in records]
        best = [min(x["eval_loss"] for x in r if "eval_loss" in x) for r in records]
        losses = [next(x["loss"] for x in reversed(r) if "loss" in x) for r in records]
        scores = [r[-1]["task/sums/acc_norm"] for r in records]
        assert "task/sums/examples" not in group  # what the scores are over, not a result
        for metric, values in (
            ("eval_loss", last),
            ("best_eval_loss", best),
            ("loss", losses),
            ("task/sums/acc_norm", scores),
        ):
            assert group[metric]["n"] == 2
            assert group[metric]["mean"] == pytest.approx(sum(values) / 2, rel=1e-12)
            assert group[metric]["std"] == pytest.approx(abs(values[0] - values[1]) / 2**0.5)


def test_sigterm_then_the_same_sweep_again_equals_an_unbroken_sweep(swept, tmp_path, monkeypatch):
    directory, _, _ = swept
    step_of, calls = lanes.Vmapped.step, []

    def stopping_at_step_12(self, *args):
        calls.append(1)
        if len(calls) == 12:
            os.kill(os.getpid(), signal.SIGTERM)
        return step_of(self, *args)

    cfg = load_config(None, [*SETTINGS, *task_files(tmp_path), f"run_dir={tmp_path / 's'}"])
    monkeypatch.setattr(lanes.Vmapped, "step", stopping_at_step_12)
    with pytest.raises(Interrupted) as stopped:
        sweep(cfg, VARY, vmap=True, log=lambda _: None)
    assert stopped.value.step == 12
    said = str(stopped.value)
    assert said.startswith("SIGTERM at step 12: checkpoints saved of the members ") and all(
        name in said for name in MEMBERS
    )
    assert said.endswith("; run the same command to resume"), said
    stopped_summary = read_summary(tmp_path / "s")  # made from what the members logged so far
    assert stopped_summary["groups"]["lr=1e-3"]["loss"]["n"] == 2
    assert {m["results"]["step"] for m in stopped_summary["members"].values()} == {10}
    monkeypatch.undo()
    lines = []
    sweep(cfg, VARY, vmap=True, log=lines.append)
    assert (
        f"{MEMBERS[0]}: resumed from step 12 of {tmp_path / 's' / MEMBERS[0]}/checkpoints" in lines
    )
    for name in MEMBERS:
        assert numbers(tmp_path / "s" / name) == numbers(directory / name), name


@pytest.mark.parametrize("vmap", [False, True])
def test_members_resumed_at_other_steps_wait_for_each_other_and_end_as_unbroken(tmp_path, vmap):
    """With ``checkpoint.keep=1`` a member may hold only a later step than another (killed while
    saving), or none at all (killed after logging, before its first save): each resumes from its
    own newest, the ones ahead wait (stepped in turn: not stepped; vmapped: their flags off, given
    another's batch), and every logged number equals an unbroken sweep's."""
    settings = [
        *SETTINGS,
        "seed=0",
        "checkpoint.every=4",
        "checkpoint.keep=1",
        "train.log_every=4",
        "train.eval_every=4",
        "optimizer.schedule=constant",
    ]
    vary = {"optimizer.lr": ["1e-3", "3e-3"]}

    def swept(directory, steps, log=lambda _: None):
        cfg = load_config(None, [*settings, f"run_dir={directory}", f"train.steps={steps}"])
        sweep(cfg, vary, vmap=vmap, log=log)

    swept(tmp_path / "unbroken", 12)
    directory = tmp_path / "s"
    swept(directory, 4)
    shutil.copytree(directory / "lr=3e-3", tmp_path / "at4")
    swept(directory, 8)
    shutil.rmtree(directory / "lr=3e-3")
    shutil.copytree(tmp_path / "at4", directory / "lr=3e-3")  # its checkpoint 4, not 8
    lines = []
    swept(directory, 12, log=lines.append)
    assert "lr=1e-3: at step 8, waits for the members at step 4" in lines
    for name in vary_names(vary):
        assert numbers(directory / name) == numbers(tmp_path / "unbroken" / name), name
    # A member that logged and saved nothing yet starts again; the other waits at its step.
    shutil.rmtree(directory / "lr=3e-3" / "checkpoints")
    lines = []
    swept(directory, 16, log=lines.append)
    assert "lr=1e-3: at step 12, waits for the members at step 0" in lines
    assert any(
        "lr=3e-3: " in line and "wrote no checkpoint: starting again" in line for line in lines
    )
    assert [r["step"] for r in read_metrics(directory / "lr=3e-3", log=None)] == [4, 8, 12, 16]


def vary_names(vary):
    return [member.name for member in sweep_members(load_config(None, ["run_dir=s"]), vary)]


def test_a_diverging_member_is_frozen_and_the_others_train_on(swept, tmp_path):
    directory, _, _ = swept
    tasks = task_files(tmp_path)
    cfg = load_config(None, [*SETTINGS, *tasks, f"run_dir={tmp_path / 's'}", "seed=0"])
    lines = []
    summary = sweep(cfg, {"optimizer.lr": ["3e-3", "1e30"]}, log=lines.append)  # in turn
    step = summary["members"]["lr=1e30"]["diverged_at"]
    assert isinstance(step, int) and 1 <= step < STEPS
    assert (
        f"lr=1e30: the loss or a gradient is not finite at step {step}; the member is frozen at "
        f"step {step - 1} and trains no further (the others go on)"
    ) in lines
    assert max(numbers(tmp_path / "s" / "lr=1e30"), default=0) < step
    assert summary["groups"]["lr=1e30"]["diverged"] == ["lr=1e30"]
    assert any(
        line.startswith("compiled one step for 2 members, run for each in turn") for line in lines
    )
    # Each member over data 8 and stepped alone, where the four were vmapped over member 4 x data 2.
    assert_close(numbers(tmp_path / "s" / "lr=3e-3"), numbers(directory / "seed=0,lr=3e-3"), 2e-4)
    saved = json.loads((tmp_path / "s" / "sweep.json").read_text())
    assert saved["diverged"] == {"lr=1e30": step}


def test_a_sweep_on_one_device_stepped_in_turn_equals_the_sweep_vmapped_on_eight(swept, tmp_path):
    directory, _, _ = swept
    entry = "import sys; from flaxformer_lite.cli import main; sys.exit(main())"
    command = [sys.executable, "-c", entry, "sweep", *SETTINGS, *task_files(tmp_path)]
    command += [
        f"run_dir={tmp_path / 's'}",
        "--vary",
        "seed=0,1",
        "--vary",
        "optimizer.lr=1e-3,3e-3",
    ]
    result = subprocess.run(
        command, env=subprocess_env(1), capture_output=True, text=True, timeout=600, check=False
    )
    assert result.returncode == 0, result.stderr
    assert "in turn, on mesh data 1 x fsdp 1 x tensor 1 (1 cpu device" in result.stdout
    for name in MEMBERS:
        assert_close(numbers(tmp_path / "s" / name), numbers(directory / name), rtol=2e-4)


def test_another_sweep_in_the_directory_is_refused_with_the_differences(swept):
    directory, _, _ = swept
    before = (directory / "sweep.json").read_text()
    cfg = load_config(None, [*SETTINGS, f"run_dir={directory}", "optimizer.b1=0.8"])
    with pytest.raises(ConfigError) as refused:
        sweep(cfg, {"seed": ["0", "1", "2"]}, log=lambda _: None)
    message = str(refused.value)
    assert "holds another sweep" in message and "optimizer.b1: 0.9 -> 0.8" in message
    assert "members new in it ['seed=0', 'seed=1', 'seed=2']" in message
    assert (directory / "sweep.json").read_text() == before


@pytest.mark.parametrize(
    ("arguments", "says"),
    [
        (["--vary", "optimizer.lrr=1,2"], "did you mean 'optimizer.lr'?"),
        (["--vary", "train.batch_size=8,x"], "train.batch_size"),
        ([], "a sweep varies at least one setting"),
        (["--vary", "seed=1,1"], "two members are named 'seed=1'"),
        (["--vary", "seed"], "--vary takes KEY=V1,V2,..."),
        (["--vary", "run_dir=a,b"], "run_dir is the sweep's"),
    ],
)
def test_bad_input_exits_2_with_one_line_and_writes_nothing(tmp_path, capsys, arguments, says):
    status = main(["sweep", *arguments, f"run_dir={tmp_path / 's'}"])
    err = capsys.readouterr().err
    assert status == 2 and says in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "s").exists()


def test_a_directory_holding_a_run_is_refused(tmp_path, capsys):
    with RunDir(tmp_path / "s").locked():  # a run's directory, as train.py starts one
        (tmp_path / "s" / "metrics.jsonl").write_text('{"step": 1}\n')
    held = sorted(p.name for p in (tmp_path / "s").iterdir())
    assert main(["sweep", "--vary", "seed=0,1", f"run_dir={tmp_path / 's'}"]) == 2
    assert "holds a run (train.py's), not a sweep" in capsys.readouterr().err
    assert sorted(p.name for p in (tmp_path / "s").iterdir()) == held


def test_compare_two_groups_says_the_difference_its_error_and_whether_it_is_noise(swept, capsys):
    directory, summary, _ = swept
    assert main(["compare", f"{directory}:lr=1e-3", f"{directory}:lr=3e-3"]) == 0
    printed = capsys.readouterr().out
    a, b = summary["groups"]["lr=1e-3"], summary["groups"]["lr=3e-3"]
    members = summary["members"]
    diff = difference(*(metric_values(g, members, "eval_loss") for g in (a, b)))
    assert diff["test"] == "paired t over 2 shared seeds"  # both groups trained on seeds 0, 1
    assert f"eval_loss: difference {diff['difference']:+.4g}, 95% CI [" in printed
    assert f"p = {diff['p']:.2g} (paired t over 2 shared seeds, df 1)" in printed
    assert ("within noise" if diff["within_noise"] else "beyond noise") in printed
    assert "loss: difference" in printed and "no held-out measure" in printed
    metric = "task/sums/acc_norm"  # a downstream task's score, as any metric
    assert (
        main(["compare", f"{directory}:lr=1e-3", f"{directory}:lr=3e-3", "--metric", metric]) == 0
    )
    diff = difference(*(metric_values(g, members, metric) for g in (a, b)))
    assert f"{metric}: difference {diff['difference']:+.4g}" in capsys.readouterr().out
    assert main(["compare", str(directory), str(directory / MEMBERS[0])]) == 2
    assert "compare takes two sweeps" in capsys.readouterr().err
    assert main(["compare", f"{directory}:lr=1", f"{directory}:lr=3e-3"]) == 2
    assert "has no group 'lr=1'; its groups: lr=1e-3, lr=3e-3" in capsys.readouterr().err


def test_a_sweep_stopped_before_a_group_plots_the_rest_and_compare_says_why_not(
    swept, tmp_path, capsys
):
    """The members of group lr=3e-3 never logged (a sweep stopped before their program): plot
    draws the others and names them; compare of the two groups says what is missing."""
    directory, _, _ = swept
    stopped = tmp_path / "s"
    shutil.copytree(directory, stopped)
    record = json.loads((stopped / "sweep.json").read_text())
    record.pop("summary")  # a sweep that never finished has none
    (stopped / "sweep.json").write_text(json.dumps(record))
    waiting = [name for name in MEMBERS if name.endswith("lr=3e-3")]
    for name in waiting:
        shutil.rmtree(stopped / name)
    assert main(["plot", str(stopped)]) == 0
    printed = capsys.readouterr().out.strip().splitlines()
    assert printed == [
        f"wrote {stopped / 'plots' / 'sweep.png'}",
        f"left out, not logged yet: {', '.join(waiting)} (the same sweep command resumes)",
    ]
    assert main(["compare", str(stopped)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "have no metric in common to compare" in err[0], err


def test_plot_draws_each_group_s_mean_and_spread(swept, capsys):
    directory, _, _ = swept
    assert main(["plot", str(directory)]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {directory / 'plots' / 'sweep.png'}"
    records = [read_metrics(directory / name, log=None) for name in MEMBERS[1::2]]  # lr=3e-3
    steps, mean, std = group_curve(records, "eval_loss")
    assert list(steps) == [10, 20]
    values = [[r["eval_loss"] for r in rs if "eval_loss" in r] for rs in records]
    np.testing.assert_allclose(mean, np.mean(values, axis=0), rtol=1e-12)
    np.testing.assert_allclose(std, np.std(values, axis=0, ddof=1), rtol=1e-12)


def test_a_member_loads_generates_and_exports_as_a_run(swept, tmp_path):
    directory, _, _ = swept
    member = directory / "seed=0,lr=3e-3"
    loaded = load_run(member)
    assert loaded.step == STEPS and loaded.config.optimizer.lr == 3e-3 and loaded.config.seed == 0
    assert main(["generate", "--run-dir", str(member), "--prompt", "012+034="]) == 0
    assert main(["export", "--run-dir", str(member), "--out", str(tmp_path / "hf")]) == 0
    assert (tmp_path / "hf" / "model.safetensors").is_file()


def test_a_sweep_that_does_not_fit_says_so_before_training(tmp_path, monkeypatch):
    monkeypatch.setattr(lanes.parallel, "device_memory_limit", lambda: ("host", 2**20))
    cfg = load_config(None, [*SETTINGS, f"run_dir={tmp_path / 's'}", "seed=0"])
    with pytest.raises(
        ConfigError,
        match=r"the sweep's step needs [\d.]+ MiB per device for 2 "
        r"members \([\d.]+ MiB each\); the host has 1 MiB",
    ):
        sweep(cfg, {"optimizer.lr": ["3e-3", "1e-3"]}, log=lambda _: None)
    assert not any(
        (tmp_path / "s" / name / "metrics.jsonl").exists() for name in ("lr=3e-3", "lr=1e-3")
    )


def test_fresh_moves_another_sweep_aside(tmp_path):
    other = tmp_path / "s"
    other.mkdir()
    before = {"vary": {"seed": ["5"]}, "config": {}, "members": {"seed=5": {"seed": "5"}}}
    (other / "sweep.json").write_text(json.dumps(before))
    record = {"vary": {"seed": ["0"]}, "config": {}, "members": {"seed=0": {"seed": "0"}}}
    lines = []
    assert (
        sweep_module._open_directory(
            SweepDir(other), record, fresh=True, force=False, log=lines.append
        )
        == {}
    )
    assert lines == [f"--fresh: moved the previous sweep to {tmp_path / 's.old1'}"]
    assert json.loads((tmp_path / "s.old1" / "sweep.json").read_text()) == before
    assert json.loads((other / "sweep.json").read_text()) == record | {"diverged": {}}


@pytest.mark.parametrize("link", ["sweep.json.tmp", "plots"])
def test_a_sweep_directory_holding_links_is_refused_and_their_targets_untouched(
    tmp_path, capsys, link
):
    directory, target = tmp_path / "s", tmp_path / "target"
    directory.mkdir()
    target.write_text("mine")
    record = {"vary": {}, "config": {}, "members": {}, "summary": {"members": {}, "groups": {}}}
    (directory / "sweep.json").write_text(json.dumps(record))
    (directory / link).symlink_to(target)
    assert main(["sweep", "--vary", "seed=0,1", f"run_dir={directory}"]) == 2
    assert "holds symbolic links" in capsys.readouterr().err
    assert main(["plot", str(directory)]) == 2
    assert "holds symbolic links" in capsys.readouterr().err
    assert target.read_text() == "mine"
