"""Overrides of a ``train.py`` run that compiles and steps in seconds (one layer, short rows,
no decoding), for the tests that run the command to see how it ends; those of a small run of the
embedded default that still learns (QUICK); and the trained runs that test files share
(conftest.py's ``trained_runs``)."""

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
