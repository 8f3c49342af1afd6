"""What scoring downstream tasks costs: its throughput against the model's forward pass alone,
and its share of a run's wall time.

    python benchmarks/tasks.py                             # the default and shakespeare_char
    python benchmarks/tasks.py --configs shakespeare_char --windows 5 --steps 500

For each config, its model (at its initialization: the cost does not depend on the weights) and
its rows (``train.batch_size x data.seq_len``) score the two built-in Shakespeare tasks (800 +
200 requests, tokenized by the config's tokenizer fitted on Tiny Shakespeare): ``--windows``
rounds, each timing the tasks' scoring (:class:`~flaxformer_lite.evals.Scorer`: packing on the
host, the batches placed, the forward pass, the log-likelihoods summed per request) and as many
forward passes alone (``model(ids)`` on ``[B, T]`` batches, the logits waited for), one after
the other so that a shared machine's noise hits both alike; both compiled first. Throughput is
in positions a second: the tokens the requests fill (tasks), every position of a batch
(forward); the median window of each. ``filled`` is the share of the scored batches' positions
that requests fill (the rest is packing's padding).

Then ``--steps`` steps of the config trained with the tasks every ``--every`` steps, and the
tasks' share of that run's wall time (the closing line's ``tasks`` part over its total). The
checks: scoring at half the forward pass's throughput or more, packing filling 85% of the
positions or more.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import jax
import numpy as np
from flax import nnx

from flaxformer_lite.data import readers
from flaxformer_lite.data.tokenizers import make_tokenizer
from flaxformer_lite.evals import Scorer, TaskFile, Tasks, load_task, pack
from flaxformer_lite.models.build import build_model
from flaxformer_lite.process import skip_absent_tpu, use_compilation_cache
from flaxformer_lite.train.config import load_config
from flaxformer_lite.train.loop import run
from flaxformer_lite.train.time_spent import TimeSpent

TASKS = {"next_line": "builtin:shakespeare_next_line", "last_word": "builtin:shakespeare_last_word"}
# What the checks hold scoring to: most of the forward pass's throughput, little padding.
MIN_RATIO, MIN_FILLED = 0.5, 0.85


def parser() -> argparse.ArgumentParser:
    """The command line of this benchmark (tests/test_readme.py parses the documented commands)."""
    command_line = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    command_line.add_argument("--configs", nargs="+", default=["default", "shakespeare_char"])
    command_line.add_argument("--windows", type=int, default=5)
    command_line.add_argument("--limit", type=int, default=None, help="examples per task")
    command_line.add_argument("--steps", type=int, default=500, help="steps of the timed run")
    command_line.add_argument("--every", type=int, default=100, help="steps between scorings")
    return command_line


def throughput(config: str, windows: int, limit: int | None) -> dict:
    """Positions a second of the tasks' scoring and of the forward pass alone, median windows."""
    cfg = load_config(config, ["run_dir=unused"])
    rows, length = cfg.train.batch_size, cfg.data.seq_len
    text = readers.read_text(readers.builtin_text("tinyshakespeare"))
    name = cfg.data.tokenizer or "byte"
    tokenizer = make_tokenizer(name, texts=[text], vocab_size=cfg.data.vocab_size)
    model = build_model(cfg.model.replace(vocab_size=tokenizer.vocab_size), rngs=nnx.Rngs(0))
    model.eval()
    tasks = Tasks(
        [load_task(k, TaskFile(path=path, limit=limit)) for k, path in TASKS.items()],
        tokenizer,
        length,
    )
    scorer = Scorer(rows=rows, length=length)
    scorer(model, tasks.requests)  # compiles
    graphdef, params = nnx.split(model)
    forward = jax.jit(lambda params, ids: nnx.merge(graphdef, params)(ids))
    ids = np.random.default_rng(0).integers(4, tokenizer.vocab_size, (rows, length), np.int32)
    jax.block_until_ready(forward(params, ids))
    batches = -(-tasks.tokens // (rows * length))  # at least as many as the tasks score
    scoring, passes = [], []
    for _ in range(windows):
        started = time.perf_counter()
        scorer(model, tasks.requests)
        scoring.append(tasks.tokens / (time.perf_counter() - started))
        started = time.perf_counter()
        for _ in range(batches):
            logits = forward(params, ids)
        jax.block_until_ready(logits)
        passes.append(batches * rows * length / (time.perf_counter() - started))
    used = sum(1 for _ in pack(tasks.requests, rows=rows, length=length))
    task_rate, forward_rate = statistics.median(scoring), statistics.median(passes)
    return {
        "config": config,
        "rows": f"{rows} x {length}",
        "requests": len(tasks.requests),
        "positions": tasks.tokens,
        "filled": tasks.tokens / (used * rows * length),
        "tasks_per_sec": task_rate,
        "forward_per_sec": forward_rate,
        "ratio": task_rate / forward_rate,
    }


def run_share(config: str, steps: int, every: int, limit: int | None) -> dict:
    """The tasks' seconds and share of the wall time of ``steps`` steps of ``config``."""
    with tempfile.TemporaryDirectory() as directory:
        overrides = [f"run_dir={directory}/run", f"train.steps={steps}", f"evals.every={every}"]
        for name, path in TASKS.items():
            overrides.append(f"evals.tasks.{name}.path={path}")
            if limit is not None:
                overrides.append(f"evals.tasks.{name}.limit={limit}")
        spent = TimeSpent()
        cfg = load_config(config, overrides)
        use_compilation_cache(cfg.train.compilation_cache)  # as train.py does
        run(cfg, progress=False, log=lambda _: None, spent=spent)
        parts = spent.parts()
    wall = sum(parts.values())
    return {"run_seconds": wall, "tasks_seconds": parts["tasks"], "share": parts["tasks"] / wall}


def main(argv: list[str] | None = None) -> dict:
    args = parser().parse_args(argv)
    rows = []
    for config in args.configs:
        row = throughput(config, args.windows, args.limit)
        row |= run_share(config, args.steps, args.every, args.limit)
        rows.append(row)
    print(
        "| config | rows | requests | positions (filled) | tasks pos/s | forward pos/s | "
        "tasks / forward | a run: tasks s / wall s |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(
            f"| `{row['config']}` | {row['rows']} | {row['requests']:,} | {row['positions']:,} "
            f"({row['filled']:.0%}) | {row['tasks_per_sec']:,.0f} | {row['forward_per_sec']:,.0f} "
            f"| {row['ratio']:.2f}x | {row['tasks_seconds']:.1f} / {row['run_seconds']:.1f} "
            f"({row['share']:.1%}) |"
        )
    for row in rows:
        checks = (
            (row["ratio"] >= MIN_RATIO, f"scoring at {MIN_RATIO}x the forward pass or more"),
            (row["filled"] >= MIN_FILLED, f"packing fills {MIN_FILLED:.0%} of the positions"),
        )
        for passed, what in checks:
            print(f"{'PASS' if passed else 'FAIL'}: {row['config']}: {what}")
    print(json.dumps(rows))
    return {"rows": rows}


if __name__ == "__main__":
    skip_absent_tpu()  # as the commands do
    main()
