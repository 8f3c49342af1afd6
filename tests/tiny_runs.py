"""Overrides of a ``train.py`` run that compiles and steps in seconds (one layer, short rows,
no decoding), for the tests that run the command to see how it ends; those of a small run of the
embedded default that still learns (QUICK); and the trained runs that test files share
(conftest.py's ``trained_runs`` and ``trained_translation``)."""

TINY = [
    "model.num_decoder_layers=1",
    "train.batch_size=8",
    "data.seq_len=32",
    "optimizer.warmup_steps=0",
    "train.log_every=1",
    "train.eval_every=100",
    "train.eval_batches=1",
    "data.eval_size=8",
    "train.decode_examples=0",
]

# A small, fast run of the embedded default: 8 rows of 32 tokens, no warmup surprises, quiet.
QUICK = [
    "train.batch_size=8",
    "data.seq_len=32",
    "optimizer.warmup_steps=0",
    "optimizer.schedule=constant",
    "train.log_every=5",
    "train.eval_every=10",
    "train.eval_batches=2",
    "data.eval_size=16",
]

# name -> the overrides of a run that several test files need trained (conftest.py's
# ``trained_runs``). "tiny": the embedded default (arithmetic, gpt2-tiny, byte tokenizer) cut
# to TINY, 2 steps, a checkpoint at each. "quick": the embedded default cut to QUICK, 150 steps,
# long enough to learn (test_train_e2e.py) and to compare bfloat16 with (test_bf16.py).
SHARED_RUNS = {
    "tiny": [*TINY, "train.steps=2", "checkpoint.every=1"],
    "quick": [*QUICK, "train.steps=150"],
}

# The encoder-decoder preset (configs/transformer_tiny.yaml) as conftest.py's
# ``trained_translation`` trains it for test_export.py, test_generate_cli.py and
# test_attention_maps.py: 1 + 1 scanned layers with Marian's conventions (what the export writes
# as MarianMT), on a TSV of parallel number words -> digits (BLEU is reported for translation
# data), cut to QUICK: 20 steps, evaluations and checkpoints at 10 and 20.
TRANSLATION = [
    "data.source=parallel",
    "model.num_encoder_layers=1",
    "model.num_decoder_layers=1",
    "model.scan_layers=true",
    "model.norm_eps=1e-5",
    "model.sinusoidal_layout=concat",
    "model.output_bias=true",
    *QUICK,
    "data.seq_len=40",
    "optimizer.lr=0.003",
    "train.steps=20",
    "checkpoint.every=10",
]


def task_files(directory) -> list[str]:
    """Overrides that score two downstream tasks (flaxformer_lite.evals) whose files are
    written into ``directory``: ``sums``, multiple choice on sums of the arithmetic generator's
    kind, and ``words``, LAMBADA's last word."""
    import json

    sums = [
        {
            "context": f"{a:03d}+{b:03d}=",
            "choices": [str(a + b + d) for d in (0, 1, 10)],
            "answer": 0,
        }
        for a, b in ((12, 34), (250, 250), (7, 8), (100, 1), (999, 1))
    ]
    (directory / "sums.jsonl").write_text("".join(json.dumps(s) + "\n" for s in sums))
    words = ["one plus one is two", "two and two make four", "ten minus one is nine"]
    (directory / "words.jsonl").write_text("".join(json.dumps({"text": w}) + "\n" for w in words))
    return [
        f"evals.tasks.sums.path={directory / 'sums.jsonl'}",
        "evals.tasks.sums.format=choice",
        f"evals.tasks.words.path={directory / 'words.jsonl'}",
        "evals.tasks.words.format=lambada",
    ]
