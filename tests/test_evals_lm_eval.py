"""Our task scores against lm-evaluation-harness's (EleutherAI, the field's common ruler), on a
tiny run trained here on a small corpus (a BPE tokenizer, so that the request boundaries are
tested) and its Hugging Face export:

* lm-eval's Hugging Face model (``--model hf``) on the export, and our lm-eval model
  (``flaxformer_lite``, :mod:`flaxformer_lite.evals.harness`) on the run, score the same
  lm-eval tasks (HellaSwag, ARC-Easy, PIQA, LAMBADA from lm-eval's own YAMLs, a plain choice
  task, a text's rolling log-likelihood, over local files): the same log-likelihoods, greedy
  flags, acc and acc_norm, example by example, and the same greedy generations;
* our own evaluator (the run's ``evals``: the task files read by our formats) gives those
  numbers too, on the run and on imported GPT-2 (no BOS) and Llama (BOS) checkpoints.

lm-eval runs in one subprocess (it imports torch, datasets and transformers), offline, with
no bootstrapped standard errors (their pool forks a process that holds JAX's threads).
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from subprocess_env import subprocess_env

from flaxformer_lite.cli import main
from flaxformer_lite.evals import Scorer, Tasks
from flaxformer_lite.evals.tasks import read_tasks
from flaxformer_lite.train.config import load_config
from flaxformer_lite.train.export import export_run
from flaxformer_lite.train.loop import run
from flaxformer_lite.train.trained_run import load_decoder

pytestmark = pytest.mark.fast_compile  # XLA's backend optimizations off: conftest.py
pytest.importorskip("lm_eval", reason="needs the lm-eval extra: pip install -e '.[dev]'")

LINES = [
    "the quick brown fox jumps over the lazy dog.",
    "a lazy dog sleeps, the quick fox runs!",
    "over and over: the fox, the dog, the end.",
]
LENGTH = 32  # the run's rows, and the positions both lm-eval models cut requests to
FILES = {
    "choice": [
        {
            "context": "the quick brown fox",
            "choices": ["jumps over", "sleeps", "the end."],
            "answer": 0,
        },
        {"context": "a lazy dog", "choices": ["sleeps, the", "jumps over", "dog dog"], "answer": 0},
        {"context": "over and over:", "choices": ["the fox, the dog", "quick brown"], "answer": 1},
        {"context": "the quick", "choices": ["brown fox", "lazy fox", "end"], "answer": 1},
    ],
    "hellaswag": [
        {
            "activity_label": "Fox",
            "ctx_a": "the quick brown fox jumps",
            "ctx_b": "over the",
            "endings": ["lazy dog.", "fox [title] runs", "end."],
            "label": "0",
        },
        {
            "activity_label": "Dog",
            "ctx_a": "a lazy dog",
            "ctx_b": "sleeps, the",
            "endings": ["quick fox runs!", "dog sleeps", "over and over"],
            "label": 1,
        },
    ],
    "arc": [
        {
            "question": "what jumps?",
            "answerKey": "B",
            "choices": {"text": ["the dog", "the fox", "the end"], "label": ["A", "B", "C"]},
        },
    ],
    "piqa": [{"goal": "the lazy dog", "sol1": "sleeps", "sol2": "jumps over", "label": 0}],
    "lambada": [{"text": line.rstrip(".!")} for line in LINES],
    "echo": [{"text": "the quick brown fox", "answer": " jumps over the lazy dog."}],
}
# lm-eval's own task YAMLs over the files (``include`` keeps their prompts and metrics).
INCLUDED = {
    "hellaswag": "hellaswag/hellaswag.yaml",
    "arc": "arc/arc_easy.yaml",
    "piqa": "piqa/piqa.yaml",
    "lambada": "lambada/lambada_openai.yaml",
}
OWN = {
    "choice": {
        "output_type": "multiple_choice",
        "doc_to_text": "{{context}}",
        "doc_to_choice": "{{choices}}",
        "doc_to_target": "{{answer}}",
        "metric_list": [{"metric": "acc"}, {"metric": "acc_norm"}],
    },
    "echo": {
        "output_type": "generate_until",
        "doc_to_text": "{{text}}",
        "doc_to_target": "{{answer}}",
        "generation_kwargs": {"until": ["!"], "max_gen_toks": 12},
        "metric_list": [{"metric": "exact_match"}],
    },
    "corpus": {
        "output_type": "loglikelihood_rolling",
        "doc_to_text": "",
        "doc_to_target": "{{text}}",
        "metric_list": [{"metric": "word_perplexity"}, {"metric": "byte_perplexity"}],
    },
}
SCRIPT = """
import json, sys
import lm_eval
from lm_eval.tasks import TaskManager
import flaxformer_lite.evals.harness  # registers flaxformer_lite beside lm-eval's own models
tasks_dir, jobs, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
manager = TaskManager(include_path=tasks_dir)
found = {}
for name, (model, args, tasks) in jobs.items():
    result = lm_eval.simple_evaluate(
        model=model, model_args=args, tasks=tasks, task_manager=manager, log_samples=True,
        device="cpu", batch_size=4, bootstrap_iters=0,
    )
    found[name] = {
        task: [{"resps": s["resps"], "acc": s.get("acc"), "acc_norm": s.get("acc_norm")}
               for s in samples]
        for task, samples in result["samples"].items()
    }
    found[name]["results"] = result["results"]
json.dump(found, open(out, "w"), default=str)
# lm-eval's own command line with our model registered (python -m flaxformer_lite.evals.harness).
flaxformer_lite.evals.harness.main([
    "--model", "flaxformer_lite", "--model_args", jobs["ours"][1], "--tasks", "t_choice",
    "--include_path", tasks_dir, "--batch_size", "4", "--output_path", out + ".cli",
])
"""
IMPORTED = ("gpt2", "llama")  # random checkpoints: GPT-2's tokenizer adds no BOS, Llama's does


@pytest.fixture(scope="module")
def scored(tmp_path_factory, hf):
    """The run, its export, two imported checkpoints, the task files, and what lm-eval's
    models gave on them."""
    import hf_checkpoints
    import lm_eval

    root = tmp_path_factory.mktemp("lm_eval")
    (root / "corpus.txt").write_text("\n".join(LINES * 40) + "\n")
    for name, objects in FILES.items():
        (root / f"{name}.jsonl").write_text("".join(json.dumps(o) + "\n" for o in objects))
    (root / "corpus.jsonl").write_text(json.dumps({"text": " ".join(LINES)}) + "\n")
    run_dir = root / "run"
    overrides = [
        f"run_dir={run_dir}",
        "data.source=text",
        f"data.path={root / 'corpus.txt'}",
        "data.text_documents=lines",
        "data.tokenizer=bpe",
        "data.vocab_size=280",
        "model.num_decoder_layers=1",
        "train.steps=40",
        "train.batch_size=8",
        f"data.seq_len={LENGTH}",
        "optimizer.lr=0.01",
        "optimizer.warmup_steps=0",
        "train.log_every=40",
        "train.eval_every=40",
        "train.decode_examples=0",
    ]
    run(load_config(None, overrides), progress=False, log=lambda _: None)
    export_run(run_dir, root / "hf")
    tasks_dir = root / "tasks"
    tasks_dir.mkdir()
    library = __import__("pathlib").Path(lm_eval.__file__).parent / "tasks"
    for name in [*INCLUDED, *OWN]:
        split = "validation" if name == "hellaswag" else "test"
        config = {
            "task": f"t_{name}",
            "dataset_path": "json",
            "dataset_name": None,
            "dataset_kwargs": {"data_files": {split: str(root / f"{name}.jsonl")}},
            "training_split": None,
            "validation_split": "validation" if split == "validation" else None,
            "test_split": "test" if split == "test" else None,
        }
        if name in INCLUDED:
            config["include"] = str(library / INCLUDED[name])
        else:
            config |= OWN[name]
        (tasks_dir / f"t_{name}.yaml").write_text(json.dumps(config))
    hf_checkpoints.gpt2_dir(hf.transformers, hf.torch, root / "gpt2")
    hf_checkpoints.llama_dir(hf.transformers, hf.torch, root / "llama")
    scoring = [f"t_{name}" for name in [*INCLUDED, "choice", "corpus"]]
    hf_args = f"dtype=float32,max_length={LENGTH}"
    jobs = {
        "hf": ["hf", f"pretrained={root / 'hf'},{hf_args}", [*scoring, "t_echo"]],
        "ours": [
            "flaxformer_lite",
            f"run_dir={run_dir},max_length={LENGTH}",
            [*scoring, "t_echo"],
        ],
        **{name: ["hf", f"pretrained={root / name},{hf_args}", scoring] for name in IMPORTED},
    }
    out = root / "lm_eval.json"
    offline = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(root / "hf_home")}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tasks_dir), json.dumps(jobs), str(out)],
        env=subprocess_env(1, **offline),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return root, json.loads(out.read_text())


def _lls(samples) -> list[list[float]]:
    return [[float(resp[0][0]) for resp in sample["resps"]] for sample in samples]


@pytest.mark.slow
def test_our_lm_eval_model_scores_as_lm_evals_hugging_face_model(scored):
    root, found = scored
    for task in [f"t_{name}" for name in [*INCLUDED, "choice"]]:
        theirs, ours = found["hf"][task], found["ours"][task]
        assert len(theirs) == len(ours) == len(FILES[task[2:]]), task
        for number, (a, b) in enumerate(zip(theirs, ours, strict=True)):
            where = f"{task} example {number}"
            np.testing.assert_allclose(_lls([b]), _lls([a]), rtol=1e-5, atol=2e-4, err_msg=where)
            greedy = [[resp[0][1] for resp in s["resps"]] for s in (a, b)]
            assert greedy[0] == greedy[1], where
            assert (a["acc"], a["acc_norm"]) == (b["acc"], b["acc_norm"]), where
    # A text's rolling windows: the same perplexities.
    for metric in ("word_perplexity,none", "byte_perplexity,none"):
        theirs, ours = (found[name]["results"]["t_corpus"][metric] for name in ("hf", "ours"))
        assert ours == pytest.approx(theirs, rel=1e-4), metric
    assert found["ours"]["results"]["t_hellaswag"]["acc_norm,none"] == pytest.approx(
        found["hf"]["results"]["t_hellaswag"]["acc_norm,none"]
    )
    # The command line (lm-eval's, our model registered) wrote the same scores.
    [written] = (root / "lm_eval.json.cli").rglob("results_*.json")
    results = json.loads(written.read_text())["results"]["t_choice"]
    assert results["acc_norm,none"] == found["ours"]["results"]["t_choice"]["acc_norm,none"]
    # Greedy generation until "!": the same text from both models.
    generated = [[s["resps"][0][0] for s in found[name]["t_echo"]] for name in ("hf", "ours")]
    assert generated[0] == generated[1] and generated[0][0], generated


@pytest.mark.slow
@pytest.mark.parametrize("source", ["run", *IMPORTED])
def test_our_evaluator_gives_lm_evals_numbers(scored, source, tmp_path):
    """The run's ``evals`` tasks, read by our formats from the same files, on the run, and on
    imported Hugging Face checkpoints (``evaluate --hf-dir``): lm-eval's log-likelihoods example
    by example, and its perplexities of a text."""
    root, found = scored
    overrides = [f"evals.tasks.{name}.path={root / name}.jsonl" for name in [*INCLUDED, "choice"]]
    overrides += [
        f"evals.tasks.corpus.path={root / 'corpus.jsonl'}",
        "evals.tasks.corpus.format=text",
    ]
    if source == "run":
        model, tokenizer = load_decoder(run_dir=root / "run")
        reference = found["hf"]
    else:
        model, tokenizer = load_decoder(hf_dir=root / source)
        reference = found[source]
    tasks = Tasks(read_tasks(load_config(None, overrides).evals), tokenizer, LENGTH)
    loglikelihood, greedy = Scorer(rows=4, length=LENGTH)(model, tasks.requests)
    values = tasks.metrics(loglikelihood, greedy)
    for task, span in zip(tasks.tasks, tasks.spans, strict=True):
        if task.name == "corpus":  # a text's rolling windows: <sos> scored where it is a token
            results = reference["results"]["t_corpus"]
            for metric in ("word_perplexity", "byte_perplexity"):
                assert values[f"task/corpus/{metric}"] == pytest.approx(
                    results[f"{metric},none"], rel=1e-4
                )
            continue
        theirs = np.concatenate(_lls(reference[f"t_{task.name}"]))
        np.testing.assert_allclose(
            loglikelihood[span], theirs, rtol=1e-5, atol=2e-4, err_msg=task.name
        )
        results = reference["results"][f"t_{task.name}"]
        assert values[f"task/{task.name}/acc"] == pytest.approx(results["acc,none"]), task.name
        if "acc_norm,none" in results:
            assert values[f"task/{task.name}/acc_norm"] == pytest.approx(results["acc_norm,none"])
    # The command, on the same directory and tasks.
    where = (
        ["--run-dir", str(root / "run")] if source == "run" else ["--hf-dir", str(root / source)]
    )
    argv = [*where, "--max-length", str(LENGTH), "--json", str(tmp_path / "scores.json")]
    assert main(["evaluate", *argv, *overrides]) == 0
    assert json.loads((tmp_path / "scores.json").read_text()) == pytest.approx(values, rel=1e-5)
