"""Overrides of a ``train.py`` run that compiles and steps in seconds (one layer, short rows,
no decoding), for the tests that run the command to see how it ends."""

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
