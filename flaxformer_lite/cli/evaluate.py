"""``flaxformer-lite evaluate``: a trained run (its newest checkpoint, or ``--step``) or a
Hugging Face checkpoint scored on downstream tasks (:mod:`flaxformer_lite.evals`), as
lm-evaluation-harness scores them; the tasks are the run's own ``evals.tasks`` and those the
``evals.tasks.*`` settings on the command line add.

    flaxformer-lite evaluate --run-dir runs/shakespeare
    flaxformer-lite evaluate --hf-dir exports/gpt2 evals.tasks.hellaswag.path=hellaswag_val.jsonl
"""

from __future__ import annotations

import json
import pathlib
import time

from flaxformer_lite.cli.errors import guarded, notice, say
from flaxformer_lite.cli.flags import CommandParser, add_trust_code
from flaxformer_lite.evals.config import DEFAULT_ROWS


def evaluate_main(argv: list[str] | None = None) -> int:
    """Prints each task's metrics (and writes them to ``--json``); bad input exits 2."""
    args = evaluate_parser().parse_intermixed_args(argv)
    return guarded(lambda: _evaluate(args), trust_code=args.trust_code)


def evaluate_parser() -> CommandParser:
    parser = CommandParser(
        prog="flaxformer-lite evaluate",
        description="Score a run or a Hugging Face decoder LM on downstream tasks from local "
        "files (formats: hellaswag, arc, piqa, choice, lambada, text; docs/reference.md): "
        "multiple choice by acc and acc_norm, LAMBADA by the accuracy and perplexity of its "
        "last words, a text by its perplexity per token, byte and word, the numbers "
        "lm-evaluation-harness gives. A run's evals.tasks are scored, with any "
        "evals.tasks.NAME.path=FILE (and .format, .limit) given here.",
        examples=(
            "flaxformer-lite evaluate --run-dir runs/shakespeare",
            "flaxformer-lite evaluate --run-dir runs/default evals.tasks.mine.format=choice "
            "evals.tasks.mine.path=my_task.jsonl",
            "flaxformer-lite evaluate --hf-dir exports/gpt2 "
            "evals.tasks.lambada.path=lambada_test.jsonl --max-length 1024",
        ),
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--run-dir", type=pathlib.Path, help="a run directory (train.py's)")
    source.add_argument(
        "--hf-dir", type=pathlib.Path, help="a Hugging Face checkpoint directory (GPT-2, Llama)"
    )
    parser.add_argument("--step", type=int, help="the run's checkpoint (default: the newest)")
    parser.add_argument(
        "--adapter", type=pathlib.Path, help="a PEFT LoRA adapter of --hf-dir, merged in"
    )
    parser.add_argument(
        "--max-length",
        type=int,
        help="positions a request is cut to, from the left (default: the model's max_length, "
        "as lm-eval reads n_positions)",
    )
    parser.add_argument(
        "--batch-size", type=int, default=DEFAULT_ROWS, help=f"rows per batch ({DEFAULT_ROWS})"
    )
    parser.add_argument(
        "--json", type=pathlib.Path, help="also write the metrics to this new JSON file"
    )
    add_trust_code(parser)
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="evals.tasks.NAME.KEY=VALUE",
        help="tasks to score: evals.tasks.NAME.path=FILE, .format=FORMAT, .limit=N",
    )
    return parser


def _evaluate(args) -> int:
    if args.json is not None and args.json.exists():
        raise FileExistsError(f"--json {args.json} exists; name a new file")
    for key in (args.batch_size, args.max_length):
        if key is not None and key < 1:
            raise ValueError(f"--batch-size and --max-length are positive; got {key}")
    others = [o for o in args.overrides if not o.startswith("evals.")]
    if others:
        raise ValueError(f"evaluate takes evals.* settings only; got {others[0]!r}")
    from flaxformer_lite.evals import Scorer, Tasks
    from flaxformer_lite.evals.tasks import read_tasks
    from flaxformer_lite.train.config import load_config
    from flaxformer_lite.train.run_dir import RunDir
    from flaxformer_lite.train.trained_run import load_decoder

    base = None if args.run_dir is None else RunDir(args.run_dir).config
    if base is not None and not base.is_file():
        raise FileNotFoundError(f"{args.run_dir}: no config.yaml; is it a run directory?")
    evals = load_config(base, args.overrides, notify=notice).evals
    if not evals.tasks:
        raise ValueError(
            "no task to score: the run has no evals.tasks; name one, e.g. "
            "evals.tasks.hellaswag.path=hellaswag_val.jsonl"
        )
    downstream = read_tasks(evals)  # a bad task file is refused before the model is loaded
    model, tokenizer = load_decoder(
        run_dir=args.run_dir,
        hf_dir=args.hf_dir,
        step=args.step,
        trust_code=args.trust_code,
        who="evaluate",
        adapter=args.adapter,
    )
    length = args.max_length or model.config.max_length
    tasks = Tasks(downstream, tokenizer, length)
    for line in tasks.notices():
        notice(line)
    started = time.perf_counter()
    values = tasks.metrics(*Scorer(rows=args.batch_size, length=length)(model, tasks.requests))
    seconds = time.perf_counter() - started
    say(_table(values))
    say(
        f"scored {len(tasks.requests):,} requests ({tasks.tokens:,} positions in rows of "
        f"{length}) in {seconds:.1f} s, compilation included"
    )
    if args.json is not None:
        args.json.write_text(json.dumps(values, indent=1) + "\n", encoding="utf-8")
        say(f"wrote {args.json}")
    return 0


def _table(values: dict[str, float]) -> str:
    """``task  metric  value  over`` rows of :meth:`Tasks.metrics`' values."""
    from flaxformer_lite.evals.tasks import UNITS
    from flaxformer_lite.train.compare import format_table

    rows, counts = [], {}
    for key, value in values.items():
        _, name, metric = key.split("/", 2)
        if metric in UNITS:
            counts[name] = f"{value:,} {metric}"
        else:
            rows.append([name, metric, f"{value:.4f}"])
    return format_table(["task", "metric", "value", "over"], [[*r, counts[r[0]]] for r in rows])
