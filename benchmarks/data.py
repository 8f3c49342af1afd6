"""The input pipelines alone, in tokens/s, side by side with their floors and peers.

Rows (one process's rows of each global batch, ``prefetch`` off, so each batch is built where it
is timed):

- the embedded default: synthetic arithmetic, 32 x 64 packed rows (``configs/default.yaml``);
- ``prepare``: a text corpus tokenized into a store with the byte tokenizer and with a BPE of
  ``--vocab`` fitted beforehand, against Hugging Face ``tokenizers``' ``encode_batch`` alone over
  the same lines (the on-the-fly text path is this prepare, once, then the store);
- a prepared store's LM rows (``documents`` and ``windows``): one process's 8 rows of 1024 of a
  global batch of 8, 16 and 64 rows at 1, 2 and 8 processes, against a nanoGPT-style sampler of
  random windows from a ``np.memmap`` of uint16 ids.

The corpus is made of files present on every machine: the Python standard library's sources,
concatenated to ``--megabytes``. Targets (ratios of the same run): store rows >= 20M tokens/s and
>= 0.1x the memmap sampler; prepare >= 0.8x ``encode_batch``; per row, one process of 8 <= 1.2x a
single process. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sysconfig
import tempfile
import time

import numpy as np

from flaxformer_lite.data.batches import Layout, TrainBatches
from flaxformer_lite.data.documents import split_documents
from flaxformer_lite.data.pipeline import DataConfig, build_data
from flaxformer_lite.data.sources import iter_text_records
from flaxformer_lite.data.store import prepare_store
from flaxformer_lite.data.tokenizers import make_tokenizer


def parser() -> argparse.ArgumentParser:
    """The command line of this benchmark (tests/test_readme.py parses the documented commands)."""
    command_line = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    command_line.add_argument("--megabytes", type=float, default=8.0, help="corpus size")
    command_line.add_argument("--vocab", type=int, default=8192, help="BPE vocabulary")
    command_line.add_argument("--batches", type=int, default=50, help="batches timed per row")
    command_line.add_argument("--repeats", type=int, default=3, help="timed rounds (best kept)")
    return command_line


def make_corpus(directory: pathlib.Path, megabytes: float) -> pathlib.Path:
    """The standard library's ``.py`` files, concatenated to ``megabytes``, one file."""
    budget, parts = int(megabytes * 2**20), []
    for path in sorted(pathlib.Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        parts.append(text)
        budget -= len(text.encode())
        if budget <= 0:
            break
    corpus = directory / "corpus.txt"
    corpus.write_text("".join(parts), encoding="utf-8")
    return corpus


def best_rate(work, tokens: int, repeats: int) -> float:
    """``tokens / seconds`` of the fastest of ``repeats`` calls of ``work()``."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return tokens / min(times)


def default_pipeline(batches: int, repeats: int, directory: pathlib.Path) -> float:
    data = build_data(
        DataConfig(), task="lm", seed=0, batch_size=32, directory=directory, prefetch=0
    )
    next(data.train)

    def work():
        for _ in range(batches):
            next(data.train)

    return best_rate(work, batches * 32 * 64, repeats)


def prepare_rates(corpus, directory, vocab: int, repeats: int):
    """tokens/s of ``encode_batch`` alone and of ``prepare`` (byte, and a given BPE), and the
    byte store: its ids outnumber BPE's about 4 to 1, so the timed rows stay within one epoch
    (each process plans an epoch's packing once, from all of its documents' lengths)."""
    lines = [r["text"] for r in iter_text_records([corpus])]
    bpe = make_tokenizer("bpe", texts=lines, vocab_size=vocab)
    tokens = sum(len(ids) for ids in bpe.encode_batch(lines))
    rates = {"encode_batch": best_rate(lambda: bpe.hf_tokenizer.encode_batch(lines), tokens, 1)}
    runs = iter(range(10**6))

    def prepare(**tokenizer):
        return lambda: prepare_store(
            directory / f"store{next(runs)}", source="text", path=str(corpus), **tokenizer
        )

    rates["prepare_bpe"] = best_rate(prepare(tokenizer=bpe), tokens, repeats)
    byte_tokens = sum(len(line.encode()) for line in lines)
    rates["prepare_byte"] = best_rate(prepare(tokenizer_kind="byte"), byte_tokens, repeats)
    store = prepare_store(directory / "bytes", source="text", path=str(corpus))
    return rates, store


def store_rows(store, rows: str, processes: int, batches: int, repeats: int) -> float:
    """tokens/s of process 0's 8 rows of 1024 (of a global batch of ``8 * processes`` rows, as
    data parallelism grows it) from ``store``."""
    train, _ = split_documents(store.documents.digests, 0.1, str(store.path))
    tokenizer = store.tokenizer
    layout = Layout(
        task="lm",
        rows=rows,
        seq_len=1024,
        batch_size=8 * processes,
        process_index=0,
        process_count=processes,
        sos_id=tokenizer.sos_id,
        eos_id=tokenizer.eos_id,
        vocab_size=tokenizer.vocab_size,
        mlm_probability=0.15,
        seed=0,
    )
    make = TrainBatches(store.documents, train, layout)
    make(0)  # the epoch's plan, made once per epoch

    def work():
        for step in range(1, batches + 1):
            make(step)

    return best_rate(work, batches * layout.local_size * 1024, repeats)


def memmap_sampler(store, batches: int, repeats: int) -> float:
    """nanoGPT's ``get_batch``: 8 random windows of 1025 ids from a uint16 memory map."""
    ids = np.asarray(store.documents.tokens["text"])
    path = pathlib.Path(store.path) / "benchmark_ids.bin"
    ids.astype(np.uint16).tofile(path)
    data = np.memmap(path, dtype=np.uint16, mode="r")
    rng = np.random.default_rng(0)

    def work():
        for _ in range(batches):
            starts = rng.integers(0, len(data) - 1025, 8)
            np.stack([data[s : s + 1025] for s in starts]).astype(np.int64)

    return best_rate(work, batches * 8 * 1024, repeats)


def run(args) -> dict:
    with tempfile.TemporaryDirectory() as scratch:
        scratch = pathlib.Path(scratch)
        corpus = make_corpus(scratch, args.megabytes)
        summary = {"corpus_bytes": corpus.stat().st_size}
        summary["default"] = default_pipeline(args.batches, args.repeats, scratch / "tokenizer")
        rates, store = prepare_rates(corpus, scratch, args.vocab, args.repeats)
        summary |= rates
        summary["store_tokens"] = int(len(store.documents.tokens["text"]))  # bytes
        for rows in ("documents", "windows"):
            for processes in (1, 2, 8):
                rate = store_rows(store, rows, processes, args.batches, args.repeats)
                summary[f"store_{rows}_{processes}"] = rate
        summary["memmap_sampler"] = memmap_sampler(store, args.batches, args.repeats)
    return summary


def table(s: dict) -> list[str]:
    def row(name, rate, reference=None):
        ratio = "" if reference is None else f"{rate / reference:.2f}x"
        return f"| {name} | {rate / 1e6:.2f}M | {ratio} |"

    lines = ["| pipeline alone | tokens/s | ratio |", "|---|---|---|"]
    lines.append(row("embedded default (synthetic, 32 x 64 packed)", s["default"]))
    lines.append(row("tokenizers encode_batch (BPE), alone", s["encode_batch"]))
    lines.append(row("prepare, BPE (vs encode_batch)", s["prepare_bpe"], s["encode_batch"]))
    lines.append(row("prepare, bytes", s["prepare_byte"]))
    lines.append(row("nanoGPT memmap window sampler, 8 x 1024", s["memmap_sampler"]))
    for rows in ("documents", "windows"):
        single = s[f"store_{rows}_1"]
        for processes in (1, 2, 8):
            rate = s[f"store_{rows}_{processes}"]
            name = f"store, {rows}, 1 of {processes} processes (vs memmap)"
            lines.append(row(name, rate, s["memmap_sampler"]))
        per_row = single / s[f"store_{rows}_8"]
        lines.append(f"| store, {rows}: per-row cost, 1 of 8 vs 1 of 1 | | {per_row:.2f}x |")
    return lines


def targets(s: dict) -> list[str]:
    def check(description, ok):
        return f"{'PASS' if ok else 'FAIL'}: {description}"

    out = []
    for rows in ("documents", "windows"):
        single, eight = s[f"store_{rows}_1"], s[f"store_{rows}_8"]
        out.append(check(f"store {rows} rows {single / 1e6:.1f}M >= 20M tokens/s", single >= 20e6))
        ratio = single / s["memmap_sampler"]
        out.append(check(f"store {rows} rows {ratio:.2f}x memmap sampler >= 0.1x", ratio >= 0.1))
        per_row = single / eight
        out.append(
            check(
                f"store {rows} per-row cost at 8 processes {per_row:.2f}x <= 1.2x", per_row <= 1.2
            )
        )
    ratio = s["prepare_bpe"] / s["encode_batch"]
    out.append(check(f"prepare (BPE) {ratio:.2f}x encode_batch >= 0.8x", ratio >= 0.8))
    return out


def main(argv=None) -> dict:
    command_line = parser()
    args = command_line.parse_args(argv)
    if min(args.megabytes, args.batches, args.repeats, args.vocab - 259) <= 0:
        command_line.error("--megabytes, --batches and --repeats must be positive, --vocab >= 260")
    summary = run(args)
    print(
        f"corpus: {summary['corpus_bytes'] / 2**20:.1f} MiB of Python sources; store rows from "
        f"its {summary['store_tokens']:,} byte ids; best of {args.repeats} rounds"
    )
    print("\n".join(table(summary)))
    print("\n".join(targets(summary)))
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
