"""The training step side by side: tokens/s and MFU of ours and of Hugging Face on PyTorch.

    python benchmarks/train_step.py                    # 4 layers, d_model 256, T 256, batch 8
    python benchmarks/train_step.py --layers 12 --d-model 768 --heads 12 --seq 128 --batch 4

Ours is the computation ``train.py`` runs, built the way it builds it: ``make_train_state``
(model + ``nnx.Optimizer``), ``make_optimizer`` (global-norm clipping, AdamW with the decay mask,
warmup schedule), ``make_train_step`` (``jax.jit``, the state donated, the finite check) on an
``lm`` batch of random tokens; ``train.py`` itself runs it as ``configured_train_step``, with the
optimizer's and the loss's numbers as arguments rather than constants. The model is the
embedded default's GPT-2 (pre-LN, learned positions, gelu_tanh, fused QKV, tied embeddings) at
the size given, float32, dropout off.

The peer is Hugging Face transformers' ``GPT2LMHeadModel`` of the same shape (its default
attention, ``sdpa``) with ``torch.optim.AdamW`` (same learning rate, betas, eps and weight decay)
and ``clip_grad_norm_`` when ours clips, in eager mode (``hf_gpt2.py``). It is skipped, with a
line saying so, when torch or transformers cannot be imported, or with ``--no-hf``. Its loss
covers ``T - 1`` targets per row (labels shifted inside the model), ours ``T``; both are counted
as ``B * T`` tokens.

Ours is compiled ahead of time (``.lower().compile()``, timed: ``compile_seconds``); ours, the peer
and the step's matmuls then run one untimed window. Then ``--windows`` rounds each time ``--steps``
consecutive steps of ours and then of the peer, so that a shared machine's noise hits both alike;
the median window gives the seconds per step. MFU is training FLOPs per token
(``training_flops_per_token``: 6 x matmul parameters + attention, as train.py logs it) x tokens/s
over the float32 peak of a 2048^3 matmul measured by XLA in the same run (before the first window
and after each; the best of them). Each window also counts the process's minor page faults and
kernel CPU seconds per step (``getrusage``): memory mapped afresh every step is zeroed by the
kernel page by page, a cost outside the frameworks' arithmetic that hardly depends on the
machine's load. Run as a script, it first makes glibc keep freed memory for
reuse, as ``train.py`` does (:mod:`flaxformer_lite.process`): a setting of the whole
process, so the peer runs under it too. After each window, every matmul of our step is timed
alone in XLA and in PyTorch (``matmuls.py``): what our step would take if it were only its
matmuls, an optimistic floor set against both steps and the target. The output is a table,
PASS/FAIL lines for the targets at the default size (ratio >= 1.25, MFU >= 65%) and, as the last
line, one JSON object.

``--train-py`` then alternates ``--windows`` fresh runs of ``train.py``'s loop
(``flaxformer_lite.train.loop.run``) on the same config, on full rows of random words whose word
tokenizer has exactly the benchmark's vocabulary, with windows of the step: each run takes
``2 * steps`` steps and logs the tokens/s of its second ``--steps`` (the first holds the
compiling step), which is divided by the step's tokens/s over the windows right before and after
it. The median of these shares must be within 5% of 1: the loop (data pipeline, host
transfers, the per-step finite check, metrics) costs the run next to nothing. Pairing the
windows matters on a shared machine whose speed drifts over minutes. The loop uses every
device, as train.py does: run it on one.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import resource
import statistics
import sys
import tempfile
import time

import jax
import numpy as np
from flax import nnx

from flaxformer_lite.data.tasks import TASKS
from flaxformer_lite.models.accounting import training_flops_per_token
from flaxformer_lite.process import reuse_freed_host_memory, skip_absent_tpu
from flaxformer_lite.train.config import TrainConfig, load_config
from flaxformer_lite.train.optim import make_optimizer
from flaxformer_lite.train.peak_flops import matmul_peak_flops
from flaxformer_lite.train.program import make_train_state
from flaxformer_lite.train.step import make_train_step

import hf_gpt2
from loop_vs_step import logged_tokens_per_sec, paired_shares, short_run_overrides
from matmuls import StepMatmuls

DEFAULT_SIZE = dict(layers=4, d_model=256, heads=4, seq=256, batch=8, vocab=8192)
RATIO_TARGET = 1.25  # our tokens/s over Hugging Face's, at the default size
TRAIN_PY_TOLERANCE = 0.05  # train.py's logged tokens/s within 5% of the timed step's
MFU_TARGET = 0.65
# The model settings the summary reports.
MODEL_KEYS = ("num_decoder_layers", "d_model", "num_heads", "d_ff", "vocab_size", "scan_layers")


def train_config(args, extra: dict | None = None) -> TrainConfig:
    """The benchmark's config: the embedded default at the size of ``args``, dropout off, then
    the ``extra`` overrides (``{"data.packing": False}``)."""
    overrides = {
        "model.num_decoder_layers": args.layers,
        "model.d_model": args.d_model,
        "model.num_heads": args.heads,
        "model.d_ff": args.d_ff or 4 * args.d_model,
        "model.vocab_size": args.vocab,
        "model.max_length": args.seq,
        "model.embedding_dropout": 0.0,
        "model.attention_dropout": 0.0,
        "model.residual_dropout": 0.0,
        "model.scan_layers": args.scan_layers,
        "data.seq_len": args.seq,
        "train.batch_size": args.batch,
        "seed": args.seed,
    }
    overrides |= extra or {}
    return load_config(None, [f"{key}={value}" for key, value in overrides.items()])


def random_batch(cfg: TrainConfig, seed: int) -> dict[str, np.ndarray]:
    """An ``lm`` batch: ``inputs``, ``targets`` int32 and ``weights`` float32 ``[B, T]``."""
    rng = np.random.default_rng(seed)
    shape = (cfg.train.batch_size, cfg.data.seq_len + 1)
    tokens = rng.integers(0, cfg.model.vocab_size, shape).astype(np.int32)
    weights = np.ones((shape[0], shape[1] - 1), np.float32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "weights": weights}


def measured(call, *args) -> tuple[float, int, float]:
    """``call(*args)``'s wall-clock seconds, and the minor page faults and kernel (system) CPU
    seconds of this whole process meanwhile: the price of memory that the allocator maps afresh,
    which the kernel zeroes page by page on first touch."""
    before, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    call(*args)
    seconds, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF)
    return seconds, after.ru_minflt - before.ru_minflt, after.ru_stime - before.ru_stime


# ----------------------------------------------------------------------------- ours
class OurStep:
    """The compiled train step and its state; ``run(k)`` takes ``k`` steps."""

    def __init__(self, cfg: TrainConfig, batch: dict[str, np.ndarray]):
        tx, _ = make_optimizer(cfg.optimizer, cfg.model, total_steps=cfg.train.steps)
        model, optimizer = make_train_state(cfg, tx)
        graphdef, self.state = nnx.split((model, optimizer))
        self.parameters = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
        self.batch = jax.device_put(batch)
        step = make_train_step(graphdef, task=TASKS["lm"])
        start = time.perf_counter()
        traced = step.trace(self.state, self.batch)
        self.step = traced.lower().compile()
        self.compile_seconds = time.perf_counter() - start
        self.jaxpr = traced.jaxpr.jaxpr
        self.losses: list[float] = []

    def run(self, steps: int) -> None:
        for _ in range(steps):
            self.state, metrics = self.step(self.state, self.batch)
        self.losses.append(float(metrics["loss"]))  # waits for the last step


# ----------------------------------------------------------------------------- train.py
def write_words(args, directory: str) -> pathlib.Path:
    """A text file for train.py: lines of ``--seq`` random words ``w0 w1 ...``, each filling a
    row (no packing, so no segment masks: the computation of the timed step), and more distinct
    words than the vocabulary has ids, so the word tokenizer (and the model) get exactly
    ``--vocab``."""
    rng = np.random.default_rng(args.seed)
    words = np.char.add("w", rng.integers(0, 2 * args.vocab, 32 * args.vocab).astype(str))
    lines = [
        " ".join(row) for row in words[: len(words) // args.seq * args.seq].reshape(-1, args.seq)
    ]
    text = pathlib.Path(directory, "words.txt")
    text.write_text("\n".join(lines) + "\n")
    return text


def train_py_tokens_per_sec(args, text: pathlib.Path, run_dir: pathlib.Path) -> float:
    """The tokens/s that a fresh run of train.py's loop on the benchmark's config logs over
    ``--steps`` steps, after a first window of as many that holds the compiling step."""
    data = {
        "data.source": "text",
        "data.path": text,
        "data.tokenizer": "word",
        "data.vocab_size": args.vocab,
        "data.packing": False,
    }
    cfg = train_config(args, data | short_run_overrides(run_dir, args.steps))
    return logged_tokens_per_sec(cfg)


# ----------------------------------------------------------------------------- the benchmark
def run(args) -> dict:
    cfg = train_config(args)
    batch = random_batch(cfg, args.seed)
    tokens_per_step = cfg.train.batch_size * cfg.data.seq_len
    flops_per_token = training_flops_per_token(cfg.model, cfg.data.seq_len)
    peaks = [matmul_peak_flops()]  # and after each window: MFU is against the best
    print(f"matmul peak {peaks[0] / 1e9:.0f} GFLOP/s", file=sys.stderr, flush=True)

    ours = OurStep(cfg, batch)
    print(f"compiled in {ours.compile_seconds:.1f} s", file=sys.stderr, flush=True)
    libraries, peer_skipped = (None, "--no-hf") if args.no_hf else hf_gpt2.load_torch()
    peer = None if libraries is None else hf_gpt2.TrainStep(libraries, cfg, batch)
    matmuls = StepMatmuls(ours.jaxpr, None if peer is None else libraries[0])
    # One untimed window of everything first. Our first timed window can still be slower than
    # the later ones (the cause is not known): the median of the windows is what is reported.
    for step in (ours, peer):
        if step is not None:
            step.run(args.steps)
    matmuls.seconds()

    windows = {"ours": [], "peer": []}  # per window: seconds, page faults, kernel CPU s per step
    matmul_seconds = []  # per window: (XLA, PyTorch or None) seconds of the step's matmuls
    for window in range(args.windows):
        for name, step in (("ours", ours), ("peer", peer)):
            if step is not None:
                use = measured(step.run, args.steps)
                windows[name].append([value / args.steps for value in use])
        matmul_seconds.append(matmuls.seconds())
        peaks.append(matmul_peak_flops())
        print(f"window {window + 1}/{args.windows} done", file=sys.stderr, flush=True)

    def medians(name: str) -> tuple[list[float], float, float, float]:
        seconds, faults, system = zip(*windows[name], strict=True)
        return list(seconds), *(statistics.median(v) for v in (seconds, faults, system))

    window_seconds, seconds, faults, system = medians("ours")
    peak = max(peaks)
    tokens_per_sec = tokens_per_step / seconds
    summary = {
        "jax": jax.__version__,
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "backend": jax.default_backend(),
        "model": {k: getattr(cfg.model, k) for k in MODEL_KEYS},
        "seq_len": cfg.data.seq_len,
        "batch_size": cfg.train.batch_size,
        "parameters": ours.parameters,
        "flops_per_token": flops_per_token,
        "matmul_peak_flops": peak,
        "matmul_peaks_measured": peaks,
        "steps_per_window": args.steps,
        "windows": args.windows,
        "step_seconds": seconds,
        "window_step_seconds": window_seconds,
        "page_faults_per_step": faults,
        "system_cpu_seconds_per_step": system,
        "tokens_per_sec": tokens_per_sec,
        "mfu": flops_per_token * tokens_per_sec / peak,
        "compile_seconds": ours.compile_seconds,
        "losses": ours.losses,
        "peer_skipped": peer_skipped,
        "peer_tokens_per_sec": None,
        "ratio": None,
        "matmuls_per_step": sum(matmuls.counts.values()),
        "matmul_flops_per_step": matmuls.flops,
        "matmul_while_loops": matmuls.while_loops,
        "window_matmul_seconds": [xla for xla, _ in matmul_seconds],
        "matmul_seconds": statistics.median(xla for xla, _ in matmul_seconds),
    }
    if peer is not None:
        peer_window_seconds, peer_seconds, peer_faults, peer_system = medians("peer")
        summary |= {
            "torch": libraries[0].__version__,
            "transformers": libraries[1].__version__,
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
            "peer_parameters": peer.parameters,
            "peer_step_seconds": peer_seconds,
            "peer_window_step_seconds": peer_window_seconds,
            "peer_page_faults_per_step": peer_faults,
            "peer_system_cpu_seconds_per_step": peer_system,
            "peer_tokens_per_sec": tokens_per_step / peer_seconds,
            "peer_mfu": flops_per_token * tokens_per_step / peer_seconds / peak,
            "peer_losses": peer.losses,
            "ratio": peer_seconds / seconds,
            "window_torch_matmul_seconds": [torch for _, torch in matmul_seconds],
            "torch_matmul_seconds": statistics.median(torch for _, torch in matmul_seconds),
        }
    if args.train_py:
        # Paired windows: each of train.py's is compared with the step's windows right before
        # and after it, so that the shared machine's changes of speed, which last minutes, hit
        # both sides of each comparison alike.
        logged, between = [], [window_seconds[-1]]
        with tempfile.TemporaryDirectory() as directory:
            text = write_words(args, directory)
            for window in range(args.windows):
                run_dir = pathlib.Path(directory, f"run{window}")
                logged.append(train_py_tokens_per_sec(args, text, run_dir))
                between.append(measured(ours.run, args.steps)[0] / args.steps)
                print(
                    f"train.py window {window + 1}/{args.windows} done", file=sys.stderr, flush=True
                )
        shares = paired_shares(logged, between, tokens_per_step)
        summary |= {
            "train_py_window_tokens_per_sec": logged,
            "train_py_tokens_per_sec": statistics.median(logged),
            "window_step_seconds_between_train_py": between,
            "train_py_window_shares": shares,
            "train_py_share": statistics.median(shares),
        }
    return summary


def table(summary: dict) -> list[str]:
    lines = [
        "| | tokens/s | ms/step | MFU | compile s | page faults/step | kernel CPU s/step |",
        "|---|---|---|---|---|---|---|",
    ]
    lines.append(
        f"| flaxformer_lite (JAX) | {summary['tokens_per_sec']:.0f} | "
        f"{1e3 * summary['step_seconds']:.1f} | {100 * summary['mfu']:.1f}% | "
        f"{summary['compile_seconds']:.1f} | {summary['page_faults_per_step']:.0f} | "
        f"{summary['system_cpu_seconds_per_step']:.3f} |"
    )
    if summary["peer_skipped"] is None:
        lines.append(
            f"| Hugging Face GPT2LMHeadModel (PyTorch eager) | "
            f"{summary['peer_tokens_per_sec']:.0f} | "
            f"{1e3 * summary['peer_step_seconds']:.1f} | "
            f"{100 * summary['peer_mfu']:.1f}% | - | "
            f"{summary['peer_page_faults_per_step']:.0f} | "
            f"{summary['peer_system_cpu_seconds_per_step']:.3f} |"
        )
    if "train_py_tokens_per_sec" in summary:
        tokens_per_sec = summary["train_py_tokens_per_sec"]
        seconds = summary["batch_size"] * summary["seq_len"] / tokens_per_sec
        mfu = summary["flops_per_token"] * tokens_per_sec / summary["matmul_peak_flops"]
        lines.append(
            f"| train.py's logged steady state (JAX) | {tokens_per_sec:.0f} | "
            f"{1e3 * seconds:.1f} | {100 * mfu:.1f}% | - | - | - |"
        )
    # The step as if it were only its matmuls, each at its best time alone.
    rows = [("our step's matmuls alone, XLA", "matmul_seconds")]
    if summary["peer_skipped"] is None:
        rows.append(("our step's matmuls alone, PyTorch (torch.einsum)", "torch_matmul_seconds"))
    for name, key in rows:
        tokens_per_sec = summary["batch_size"] * summary["seq_len"] / summary[key]
        mfu = summary["flops_per_token"] * tokens_per_sec / summary["matmul_peak_flops"]
        lines.append(
            f"| {name} | {tokens_per_sec:.0f} | {1e3 * summary[key]:.1f} | "
            f"{100 * mfu:.1f}% | - | - | - |"
        )
    return lines


def matmul_line(summary: dict) -> str:
    """What our step's matmuls take alone, against both steps and the target's step time."""
    flops, seconds = summary["matmul_flops_per_step"], summary["matmul_seconds"]
    loops = summary["matmul_while_loops"]
    line = (
        f"our step's {summary['matmuls_per_step']} matmuls ({flops / 1e9:.1f} GFLOP"
        f"{f', {loops} while loops counted once' if loops else ''}), each at its best time "
        f"alone: XLA {1e3 * seconds:.1f} ms ({flops / seconds / 1e9:.0f} GFLOP/s) = "
        f"{seconds / summary['step_seconds']:.2f}x our step"
    )
    if summary["peer_skipped"] is not None:
        return line
    torch_seconds = summary["torch_matmul_seconds"]
    target_seconds = summary["peer_step_seconds"] / RATIO_TARGET
    return (
        f"{line}; PyTorch {1e3 * torch_seconds:.1f} ms ({flops / torch_seconds / 1e9:.0f} "
        f"GFLOP/s) = {torch_seconds / summary['peer_step_seconds']:.2f}x Hugging Face's "
        f"step; {RATIO_TARGET:g}x Hugging Face's tokens/s is a step of "
        f"{1e3 * target_seconds:.1f} ms = {target_seconds / seconds:.2f}x XLA's "
        "matmuls"
    )


def checks(summary: dict, default_size: bool) -> list[str]:
    lines = []
    if "train_py_tokens_per_sec" in summary:
        share = summary["train_py_share"]
        ok = abs(share - 1) <= TRAIN_PY_TOLERANCE
        lines.append(
            f"{'PASS' if ok else 'FAIL'}: train.py's logged tokens/s = {100 * share:.1f}%"
            f" of the step's (median over windows, each against the step timed right "
            f"before and after it), within {100 * TRAIN_PY_TOLERANCE:.0f}%"
        )
    if not default_size:
        return lines
    lines += [
        f"{'PASS' if summary['mfu'] >= MFU_TARGET else 'FAIL'}: MFU = "
        f"{100 * summary['mfu']:.1f}% >= {100 * MFU_TARGET:.0f}%"
    ]
    if summary["ratio"] is not None:
        ok = summary["ratio"] >= RATIO_TARGET
        lines.append(
            f"{'PASS' if ok else 'FAIL'}: tokens/s / Hugging Face = "
            f"{summary['ratio']:.2f}x >= {RATIO_TARGET:g}x"
        )
    return lines


def parser() -> argparse.ArgumentParser:
    """The command line of this benchmark (tests/test_readme.py parses the documented commands)."""
    command_line = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    command_line.add_argument("--layers", type=int, default=DEFAULT_SIZE["layers"])
    command_line.add_argument("--d-model", type=int, default=DEFAULT_SIZE["d_model"])
    command_line.add_argument("--heads", type=int, default=DEFAULT_SIZE["heads"])
    command_line.add_argument("--d-ff", type=int, default=0, help="0: 4 * d_model")
    command_line.add_argument("--seq", type=int, default=DEFAULT_SIZE["seq"])
    command_line.add_argument("--batch", type=int, default=DEFAULT_SIZE["batch"])
    command_line.add_argument("--vocab", type=int, default=DEFAULT_SIZE["vocab"])
    command_line.add_argument("--scan-layers", action="store_true", help="model.scan_layers=true")
    command_line.add_argument("--steps", type=int, default=5, help="steps per timed window")
    command_line.add_argument(
        "--windows", type=int, default=7, help="timed windows (median reported)"
    )
    command_line.add_argument("--no-hf", action="store_true", help="skip Hugging Face transformers")
    command_line.add_argument("--seed", type=int, default=0)
    command_line.add_argument(
        "--train-py", action="store_true", help="also time train.py's loop on the same config"
    )
    return command_line


def main(argv=None) -> dict:
    command_line = parser()
    args = command_line.parse_args(argv)
    if min(args.steps, args.windows) < 1:
        command_line.error("--steps and --windows must be positive")

    summary = run(args)
    default_size = all(getattr(args, k) == v for k, v in DEFAULT_SIZE.items()) and not args.d_ff
    model = summary["model"]
    print(hf_gpt2.versions_line(summary))
    print(
        f"GPT-2-style: {model['num_decoder_layers']} layers, d_model {model['d_model']}, "
        f"{model['num_heads']} heads, d_ff {model['d_ff']}, vocab {model['vocab_size']} "
        f"({summary['parameters']:,} parameters), T {summary['seq_len']}, batch "
        f"{summary['batch_size']}, float32; matmul peak "
        f"{summary['matmul_peak_flops'] / 1e9:.0f} GFLOP/s; median of {summary['windows']} "
        f"windows of {summary['steps_per_window']} steps"
    )
    if summary["peer_skipped"] is not None:
        print(f"Hugging Face skipped: {summary['peer_skipped']}")
    print()
    print("\n".join(table(summary)))
    print()
    if summary["ratio"] is not None:
        print(f"ours / Hugging Face tokens/s: {summary['ratio']:.2f}x")
    print(matmul_line(summary))
    print("\n".join(checks(summary, default_size)))
    print(json.dumps(summary), flush=True)
    return summary


if __name__ == "__main__":
    skip_absent_tpu()  # as the commands do
    reuse_freed_host_memory()  # as train.py does, before JAX starts its backend
    main()
