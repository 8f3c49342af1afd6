"""``flaxformer-lite prepare``: tokenize a source of files once into a prepared token
store (:mod:`flaxformer_lite.data.store`), with the data settings a training run would use.

    flaxformer-lite prepare --out stores/lines data.source=text data.path='corpus/*.txt' \\
        data.tokenizer=bpe data.vocab_size=8192
    flaxformer-lite prepare --config configs/my_run.yaml --out stores/my_run
    flaxformer-lite prepare --out stores/wiki data.source=text data.path=wiki/train.txt \
        data.validation_path=wiki/valid.txt --validation-out stores/wiki_valid

Running it again on the same files and tokenizer settings does nothing; a directory holding
anything else is refused, never overwritten. A user error exits 2 with one line.
"""

from __future__ import annotations

import argparse
import functools
import pathlib
import sys
import time

from flaxformer_lite.cli.errors import guarded, notice, say
from flaxformer_lite.cli.flags import CONFIG_HELP, CommandParser

EXAMPLE = (
    "flaxformer-lite prepare --out stores/lines data.source=text "
    "data.path='corpus/*.txt' data.tokenizer=bpe data.vocab_size=8192"
)


def prepare_parser() -> argparse.ArgumentParser:
    """The ``prepare`` command's flags and its ``key=value`` overrides."""
    parser = CommandParser(
        prog="flaxformer-lite prepare",
        description="Tokenize the configured source of files once into a store "
        "of token ids (data.source, data.path, data.field, data.text_documents, data.tokenizer, "
        "data.vocab_size, data.tokenizer_path and data.validation_fraction, as train.py reads "
        "them; a fitted tokenizer sees the training part only). With data.validation_path, "
        "that source is prepared too, into --validation-out, with the same tokenizer. Running "
        "it again on the same inputs does nothing.",
        examples=(EXAMPLE,),
    )
    parser.add_argument("--config", type=pathlib.Path, help=CONFIG_HELP)
    parser.add_argument(
        "--out", type=pathlib.Path, required=True, help="the store directory to write"
    )
    parser.add_argument(
        "--validation-out",
        type=pathlib.Path,
        help="the validation store to write, from data.validation_path (which it needs)",
    )
    parser.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress bar (the default when the output is not a terminal)",
    )
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="key=value",
        help="dotted overrides, e.g. data.path='corpus/*.txt' data.tokenizer=byte",
    )
    return parser


def prepare_main(argv: list[str] | None = None) -> int:
    """Prepares the store and prints one summary line."""
    args = prepare_parser().parse_intermixed_args(argv)
    return guarded(lambda: _prepare(args))


def _prepare(args) -> int:
    from flaxformer_lite.data.plan import given_tokenizer
    from flaxformer_lite.data.run_stores import check_sources, prepare_source, prepare_validation
    from flaxformer_lite.data.sources import names_of, spelled
    from flaxformer_lite.train.config import load_config

    cfg = load_config(args.config, args.overrides, notify=notice)
    data = cfg.data
    if not data.reader.made_by_run:
        files = spelled(names_of(lambda source: source.made_by_run))
        raise ValueError(
            f"data.source={data.source!r}: prepare reads files (data.source {files}, with "
            "data.path)"
        )
    if data.mixture:
        raise ValueError(
            "data.mixture: prepare makes one store, from data.path: prepare each source on its "
            "own, or let train.py prepare the mixture's stores into RUN/prepared"
        )
    if (data.validation_path is None) != (args.validation_out is None):
        raise ValueError(
            "data.validation_path and --validation-out go together: the validation files, "
            "and the store to prepare them into"
        )
    check_sources(data)  # the validation files too, before the training store is built
    tokenizer = given_tokenizer(cfg.init_from)  # a fine-tuning run keeps the checkpoint's
    progress = None
    # A bar only on a terminal, as train.py's: in a file or a pipe it is carriage returns.
    if not args.no_progress and sys.stdout.isatty() and sys.stderr.isatty():
        from tqdm import tqdm

        progress = functools.partial(
            tqdm, unit="B", unit_scale=True, unit_divisor=1024, dynamic_ncols=True, leave=False
        )
    store = _timed(lambda: prepare_source(data, args.out, tokenizer, progress), args.out)
    if data.validation_path is not None:
        out = args.validation_out
        _timed(lambda: prepare_validation(data, out, store, progress), out)
    return 0


def _timed(prepare, out: pathlib.Path):
    """Runs ``prepare`` (of the store at ``out``) and says what it made, or found made."""
    from flaxformer_lite.data.store import MANIFEST

    existed = (out / MANIFEST).is_file()
    start = time.perf_counter()
    store = prepare()
    seconds = time.perf_counter() - start
    documents = store.manifest["documents"]
    tokens = sum(field["tokens"] for field in store.manifest["fields"].values())
    counts = f"{documents:,} documents, {tokens:,} tokens"
    if existed:
        say(f"{store.path}: already prepared ({counts})")
    else:
        say(f"prepared {store.path}: {counts}, {tokens / max(seconds, 1e-9):,.0f} tokens/s")
    return store
