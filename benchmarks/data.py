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

Then ``train.py``'s logged tokens/s against its train step alone (``loop_vs_step.py``), for the
embedded default and for gpt2-tiny on a store of the corpus prepared with the BPE above
(``--bpe-batch`` x ``--bpe-seq``): fresh runs of the loop in this process, each paired with
windows of the very step it compiled, fed its last placed batch, right before and after it.

The corpus is made of files present on every machine: the Python standard library's sources,
concatenated to ``--megabytes``. Targets (ratios of the same run): store rows >= 20M tokens/s and
>= 0.1x the memmap sampler; prepare >= 0.8x ``encode_batch``; per row, one process of 8 <= 1.2x a
single process; ``train.py`` >= 95% of its step alone (the median of the paired shares). The last
line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sysconfig
import tempfile
import time

import jax
import numpy as np

from flaxformer_lite.data.batches import Layout, TrainBatches
from flaxformer_lite.data.config import DataConfig
from flaxformer_lite.data.documents import split_documents
from flaxformer_lite.data.pipeline import build_data
from flaxformer_lite.data.readers import iter_text_records
from flaxformer_lite.data.store import prepare_store
from flaxformer_lite.data.tasks import TASKS, task_named
from flaxformer_lite.data.tokenizers import make_tokenizer
from flaxformer_lite.process import reuse_freed_host_memory, skip_absent_tpu

from loop_vs_step import train_py_against_step

SHARE_TARGET = 0.95  # train.py's logged tokens/s over its step alone's
TRAIN_PY_RUNS = ("default", "bpe")  # the summary's train_py_<name> entries, in table order


def parser() -> argparse.ArgumentParser:
    """The command line of this benchmark (tests/test_readme.py parses the documented commands)."""
    command_line = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    command_line.add_argument("--megabytes", type=float, default=8.0, help="corpus size")
    command_line.add_argument("--vocab", type=int, default=8192, help="BPE vocabulary")
    command_line.add_argument("--batches", type=int, default=50, help="batches timed per row")
    command_line.add_argument("--repeats", type=int, default=3, help="timed rounds (best kept)")
    command_line.add_argument(
        "--windows", type=int, default=5, help="train.py runs paired with the step (median)"
    )
    command_line.add_argument(
        "--default-steps", type=int, default=50, help="steps per window, embedded default"
    )
    command_line.add_argument(
        "--bpe-steps", type=int, default=10, help="steps per window, gpt2-tiny on BPE"
    )
    command_line.add_argument("--bpe-seq", type=int, default=256, help="gpt2-tiny's data.seq_len")
    command_line.add_argument(
        "--bpe-batch", type=int, default=32, help="gpt2-tiny's train.batch_size"
    )
    command_line.add_argument(
        "--no-train-py", action="store_true", help="the pipelines alone, not train.py"
    )
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
        DataConfig(), task=TASKS["lm"], seed=0, batch_size=32, directory=directory, prefetch=0
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
    lines = [r["text"] for r in iter_text_records([corpus], "lines")]
    bpe = make_tokenizer("bpe", texts=lines, vocab_size=vocab)
    tokens = sum(len(ids) for ids in bpe.encode_batch(lines))
    rates = {
        "encode_batch": best_rate(lambda: bpe.hf_tokenizer.encode_batch(lines), tokens, repeats)
    }
    runs = iter(range(10**6))
    source = {"source": "text", "path": str(corpus)}  # a line per document, as lm1b

    def prepare(**tokenizer):
        return lambda: prepare_store(
            directory / f"store{next(runs)}", documents="lines", **source, **tokenizer
        )

    rates["prepare_bpe"] = best_rate(prepare(tokenizer=bpe), tokens, repeats)
    byte_tokens = sum(len(line.encode()) for line in lines)
    rates["prepare_byte"] = best_rate(prepare(tokenizer_name="byte"), byte_tokens, repeats)
    store = prepare_store(directory / "bytes", documents="lines", **source)
    bpe_store = prepare_store(directory / "bpe", documents="lines", **source, tokenizer=bpe)
    return rates, store, bpe_store.path


def store_rows(store, rows: str, processes: int, batches: int, repeats: int) -> float:
    """tokens/s of process 0's 8 rows of 1024 (of a global batch of ``8 * processes`` rows, as
    data parallelism grows it) from ``store``."""
    train, _ = split_documents(store.documents.digests, 0.1, str(store.path))
    tokenizer = store.tokenizer
    layout = Layout(
        task=task_named("lm"),
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


def train_py_runs(args, bpe_store) -> dict[str, tuple[str, int, list[str]]]:
    """The runs of ``train.py`` compared with their step: name -> (description, steps per
    window, overrides)."""
    bpe = [
        "model.preset=gpt2-tiny",
        "data.source=prepared",
        f"data.path={bpe_store}",
        f"data.seq_len={args.bpe_seq}",
        f"train.batch_size={args.bpe_batch}",
    ]
    return {
        "default": ("embedded default (synthetic, 32 x 64 packed)", args.default_steps, []),
        "bpe": (
            f"gpt2-tiny, prepared BPE {args.vocab}, {args.bpe_batch} x {args.bpe_seq}",
            args.bpe_steps,
            bpe,
        ),
    }


def run(args) -> dict:
    with tempfile.TemporaryDirectory() as scratch:
        scratch = pathlib.Path(scratch)
        if jax.config.jax_compilation_cache_dir is None:
            # Each run of the loop compiles its step afresh, as train.py does: from the second
            # on, the same executable comes from this cache. Compiling is not what is measured.
            jax.config.update("jax_compilation_cache_dir", str(scratch / "compiled"))
        corpus = make_corpus(scratch, args.megabytes)
        summary = {"corpus_bytes": corpus.stat().st_size}
        summary["default"] = default_pipeline(args.batches, args.repeats, scratch / "tokenizer")
        rates, store, bpe_store = prepare_rates(corpus, scratch, args.vocab, args.repeats)
        summary |= rates
        summary["store_tokens"] = int(len(store.documents.tokens["text"]))  # bytes
        for rows in ("documents", "windows"):
            for processes in (1, 2, 8):
                rate = store_rows(store, rows, processes, args.batches, args.repeats)
                summary[f"store_{rows}_{processes}"] = rate
        summary["memmap_sampler"] = memmap_sampler(store, args.batches, args.repeats)
        if not args.no_train_py:
            for name, (description, steps, overrides) in train_py_runs(args, bpe_store).items():
                directory = scratch / f"train_py_{name}"
                measured = train_py_against_step(overrides, steps, args.windows, directory)
                summary[f"train_py_{name}"] = {"description": description, **measured}
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


def train_py_table(s: dict) -> list[str]:
    """train.py's logged tokens/s against the step alone: the medians of each side, and the
    median of the runs' paired shares (not the ratio of the two medians)."""
    lines = [
        "| train.py run | train.py logged tokens/s | step alone tokens/s | train.py / step |",
        "|---|---|---|---|",
    ]
    for name in TRAIN_PY_RUNS:
        if (m := s.get(f"train_py_{name}")) is not None:
            lines.append(
                f"| {m['description']} | {m['train_py_tokens_per_sec'] / 1e3:.1f}k | "
                f"{m['step_tokens_per_sec'] / 1e3:.1f}k | {100 * m['share']:.1f}% |"
            )
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
    for name in TRAIN_PY_RUNS:
        if (m := s.get(f"train_py_{name}")) is not None:
            share = m["share"]
            out.append(
                check(
                    f"train.py, {m['description']}: logged tokens/s {100 * share:.1f}% of the "
                    f"step alone's >= {100 * SHARE_TARGET:.0f}%",
                    share >= SHARE_TARGET,
                )
            )
    return out


def main(argv=None) -> dict:
    command_line = parser()
    args = command_line.parse_args(argv)
    if min(args.megabytes, args.batches, args.repeats, args.vocab - 259) <= 0:
        command_line.error("--megabytes, --batches and --repeats must be positive, --vocab >= 260")
    train_py = (args.windows, args.default_steps, args.bpe_steps, args.bpe_seq, args.bpe_batch)
    if min(train_py) <= 0:
        command_line.error(
            "--windows, --default-steps, --bpe-steps, --bpe-seq and --bpe-batch must be positive"
        )
    summary = run(args)
    print(
        f"corpus: {summary['corpus_bytes'] / 2**20:.1f} MiB of Python sources; store rows from "
        f"its {summary['store_tokens']:,} byte ids; best of {args.repeats} rounds"
    )
    print("\n".join(table(summary)))
    if not args.no_train_py:
        print(
            f"train.py: median of {args.windows} fresh runs, each against the step alone right "
            "before and after it"
        )
        print("\n".join(train_py_table(summary)))
    print("\n".join(targets(summary)))
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    skip_absent_tpu()  # as the commands do
    reuse_freed_host_memory()  # as train.py does, before JAX starts its backend
    main()
