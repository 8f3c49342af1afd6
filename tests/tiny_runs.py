"""Overrides of a ``train.py`` run that compiles and steps in seconds (one layer, short rows,
no decoding), for the tests that run the command to see how it ends; and the trained runs that
test files share (conftest.py's ``trained_runs``)."""

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

# name -> the overrides of a run that several test files need trained (conftest.py's
# ``trained_runs``). "tiny": the embedded default (arithmetic, gpt2-tiny, byte tokenizer) cut
# to TINY, 2 steps, a checkpoint at each.
SHARED_RUNS = {"tiny": [*TINY, "train.steps=2", "checkpoint.every=1"]}
