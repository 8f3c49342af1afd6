"""Downstream tasks in a run (``evals.tasks``) and after it (``flaxformer-lite evaluate``): the
scores a run logs on a mesh that splits its sequences, parameters and batches are those of its
checkpoint scored on one device, through the command as through Python; bad task files are
refused before anything is written. (The formats and requests: test_evals.py; lm-eval's own
numbers: test_evals_lm_eval.py; sweeps and two processes: test_sweep.py,
test_multiprocess.py.)"""

from __future__ import annotations

import json
import re

import pytest
from tiny_runs import TINY, task_files

from flaxformer_lite.cli import main
from flaxformer_lite.evals import Scorer, Tasks
from flaxformer_lite.evals.tasks import read_tasks
from flaxformer_lite.train.config import load_config
from flaxformer_lite.train.loop import run
from flaxformer_lite.train.metrics import read_metrics
from flaxformer_lite.train.trained_run import load_decoder

pytestmark = pytest.mark.fast_compile  # XLA's backend optimizations off: conftest.py

STEPS = ["train.steps=4", "train.eval_every=4", "checkpoint.every=4"]


def task_scores(run_dir) -> dict[str, float]:
    """The task metrics of the run's last evaluation."""
    last = read_metrics(run_dir, log=None)[-1]
    return {k: v for k, v in last.items() if k.startswith("task/")}


@pytest.mark.parametrize(
    "mesh",
    [
        ["mesh.data=2", "mesh.context=2", "mesh.tensor=2"],
        ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", "train.loss_chunk=8"],
    ],
    ids=["data2_context2_tensor2", "data2_fsdp2_tensor2_chunked"],
)
def test_a_run_on_a_mesh_scores_its_tasks_as_its_checkpoint_on_one_device(tmp_path, mesh, capsys):
    tasks = task_files(tmp_path)
    lines = []
    cfg = load_config(None, [f"run_dir={tmp_path / 'run'}", *TINY, *STEPS, *tasks, *mesh])
    run(cfg, progress=False, log=lines.append)
    logged = task_scores(tmp_path / "run")
    assert logged["task/sums/examples"] == 5 and logged["task/words/examples"] == 3
    said = [line for line in lines if line.startswith("tasks at step 4: ")]
    assert said == [
        "tasks at step 4: sums acc {:.4g}, acc_norm {:.4g} (over 5 examples); words acc {:.4g}, "
        "perplexity {:.4g} (over 3 examples)".format(
            *(
                logged[f"task/{k}"]
                for k in ("sums/acc", "sums/acc_norm", "words/acc", "words/perplexity")
            )
        )
    ], lines
    # The checkpoint, whole on one device.
    model, tokenizer = load_decoder(run_dir=tmp_path / "run")
    scored = Tasks(read_tasks(cfg.evals), tokenizer, 32)
    values = scored.metrics(*Scorer(rows=8, length=32)(model, scored.requests))
    assert values.keys() == logged.keys()
    for key, value in values.items():
        assert logged[key] == pytest.approx(value, rel=1e-5), key
    # The command: the run's own tasks, rows of its 32 positions.
    out = tmp_path / "scores.json"
    argv = ["--run-dir", str(tmp_path / "run"), "--max-length", "32", "--json", str(out)]
    assert main(["evaluate", *argv]) == 0
    printed = capsys.readouterr().out
    assert "sums   acc_norm  " in printed and "5 examples" in printed, printed
    assert json.loads(out.read_text()) == pytest.approx(values, rel=1e-5)


def test_the_closing_line_counts_the_tasks_time(tmp_path, capsys):
    argv = ["train", f"run_dir={tmp_path / 'run'}", *TINY, *STEPS, *task_files(tmp_path)]
    assert main(argv) == 0
    [closing] = [line for line in capsys.readouterr().out.splitlines() if line.startswith("done:")]
    assert re.search(r", evaluations [0-9.]+ s, tasks [0-9.]+ s, checkpoints ", closing), closing
    assert "task/sums/acc_norm " in closing and "task/sums/examples 5" in closing, closing


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (
            ["evals.tasks.x.format=choice", "evals.tasks.x.path={tmp}/missing.jsonl"],
            "{tmp}/missing.jsonl: no such task file",
        ),
        (
            ["evals.tasks.x.format=choice", "evals.tasks.x.path={tmp}/bad.jsonl"],
            "{tmp}/bad.jsonl:2: the answer's index 5 is out of range for 2 choices",
        ),
        (["evals.tasks.hs.path={tmp}/bad.jsonl"], "evals.tasks.hs: unknown task format 'hs'"),
        (
            ["evals.tasks.x.format=choice", "evals.tasks.x.path={tmp}/long.jsonl"],
            "{tmp}/long.jsonl:1: choice 0: the continuation is 41 tokens",
        ),
        (
            ["evals.tasks.x.path=y", "model.preset=transformer-tiny"],
            "evals.tasks are scored by a decoder LM",
        ),
    ],
    ids=["missing", "label", "unknown", "too_long", "encoder"],
)
@pytest.mark.parametrize("command", ["train", "sweep"])
def test_a_bad_task_exits_2_before_training_and_writes_nothing(
    tmp_path, capsys, settings, message, command
):
    (tmp_path / "bad.jsonl").write_text(
        '{"context": "c", "choices": ["a", "b"], "answer": 0}\n'
        '{"context": "c", "choices": ["a", "b"], "answer": 5}\n'
    )
    (tmp_path / "long.jsonl").write_text(
        '{"context": "c", "choices": ["' + "x" * 40 + '"], "answer": 0}\n'
    )
    settings = [s.format(tmp=tmp_path) for s in settings]
    vary = ["--vary", "seed=0,1"] if command == "sweep" else []
    status = main([command, *vary, f"run_dir={tmp_path / 'run'}", *TINY, *STEPS, *settings])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1, err
    assert err[0].startswith("error: ") and message.format(tmp=tmp_path) in err[0], err
    # Tokens are counted once the run's tokenizer is made: a run removes the directory it
    # made for it; a sweep has recorded itself by then (fixed, the same command resumes it).
    if not (command == "sweep" and "continuation" in message):
        assert not (tmp_path / "run").exists()


def test_evaluate_refuses_bad_input(tmp_path, capsys, trained_runs, trained_translation):
    run_dir = trained_runs("tiny")
    tasks = task_files(tmp_path)
    (tmp_path / "taken.json").write_text("{}")
    cases = [
        (["--run-dir", str(run_dir)], "no task to score: the run has no evals.tasks"),
        (
            ["--run-dir", str(run_dir), *tasks, "train.steps=3"],
            "evaluate takes evals.* settings only",
        ),
        (["--run-dir", str(run_dir), *tasks, "--json", str(tmp_path / "taken.json")], "exists"),
        (
            ["--run-dir", str(trained_translation[0]), *tasks],
            "evals.tasks are scored by a decoder LM",
        ),
        (["--run-dir", str(tmp_path / "nowhere"), *tasks], "no config.yaml"),
        (
            [
                "--run-dir",
                str(run_dir),
                "evals.tasks.w.path=nope.jsonl",
                "evals.tasks.w.format=text",
            ],
            "nope.jsonl: no such task file",
        ),
        (["--hf-dir", str(tmp_path), "--step", "3", *tasks], "a step applies to a run directory"),
    ]
    for argv, message in cases:
        assert main(["evaluate", *argv]) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], (argv, err)
    assert (tmp_path / "taken.json").read_text() == "{}"
