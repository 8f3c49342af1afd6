"""One accelerator, two trainers: train.py's loop and Hugging Face's ``GPT2LMHeadModel`` in
PyTorch, both in bfloat16 on float32 weights, on the same device, batch and sequence length.

    python benchmarks/gpu.py                          # on a GPU: the default and gpt2-small
    python benchmarks/gpu.py --tiny --steps 8 --log-every 4     # anywhere, at tiny sizes

The models: ``default``, the embedded default (gpt2-tiny on its arithmetic data) computing in
bfloat16; ``gpt2-small``, the shipped recipe (configs/gpt2_small.yaml: bf16, remat, the loss
in blocks, Tiny Shakespeare in BPE, whose vocabulary the model takes) without its dropout, which
the peer does not draw either. ``--tiny`` shrinks
gpt2-small to 2 layers of width 64 on rows of 64 tokens, so that a CPU runs both in seconds.

Ours is ``train.py``'s loop (:func:`flaxformer_lite.train.loop.run`) for ``--steps`` steps,
logging every ``--log-every``: tokens/s and MFU are the medians of the logged windows after the
first (the loop's clock starts after its compiling step; the peer's first window warms up), as
the loop logs them (MFU: training FLOPs per token times
tokens/s over the devices' peak, the datasheet's bf16 peak of ``train/peak_flops.py``'s table, or
on a CPU a measured matmul peak). The attention backend is the one the traced step chose, the
peak memory the device's ``peak_bytes_in_use`` (the CPU keeps no count: the process's peak
resident set instead). The peer (:func:`hf_gpt2.train_bf16`) is a ``GPT2LMHeadModel`` of the
same shape and vocabulary, SDPA attention, float32 weights under ``torch.autocast`` to bfloat16,
AdamW with the recipe's hyperparameters, timed in windows of ``--log-every`` steps on one batch
of random tokens; its MFU is ours scaled by the ratio of tokens/s (the same FLOPs per token,
the same peak). Each trainer runs in a Python process of its own: JAX and torch never share
the device's memory, and each peak is its own. Ours reads its batches from the data pipeline
every step; the peer reuses one batch, a cost ours pays and it does not.

The output is a table and, as its last line, one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import resource
import statistics
import subprocess
import sys
import tempfile

BENCHMARKS = pathlib.Path(__file__).resolve().parent
# Dropout off, as the peer has it (the embedded default has none; the recipe keeps residual
# dropout for regularisation): the comparison is of the same arithmetic.
NO_DROPOUT = ["model.embedding_dropout=0.0", "model.residual_dropout=0.0"]
MODELS = {
    "default": (None, ["model.dtype=bfloat16"]),
    "gpt2-small": ("gpt2_small", NO_DROPOUT),
}
TINY = {  # gpt2-small at a size a CPU trains in seconds
    "gpt2-small": [
        "model.num_decoder_layers=2",
        "model.d_model=64",
        "model.num_heads=2",
        "model.d_ff=256",
        "model.max_length=64",
        "data.seq_len=64",
        "data.vocab_size=320",
        "train.batch_size=4",
        "train.loss_chunk=32",
    ],
}
# The ModelConfig fields the peer's GPT2Config takes (hf_gpt2.gpt2_model).
PEER_MODEL_KEYS = (
    "vocab_size",
    "d_model",
    "num_heads",
    "d_ff",
    "num_decoder_layers",
    "max_length",
    "norm_eps",
)
PEER_OPTIMIZER_KEYS = ("lr", "b1", "b2", "eps", "weight_decay", "clip_norm")
# Runs benchmarks/{module}.py's {function} on the JSON job in argv[2], its result to argv[3].
CHILD = (
    "import importlib, json, pathlib, sys; sys.path.insert(0, sys.argv[1]); "
    "module, function = sys.argv[4].split('.'); "
    "job = json.loads(pathlib.Path(sys.argv[2]).read_text()); "
    "result = getattr(importlib.import_module(module), function)(job); "
    "pathlib.Path(sys.argv[3]).write_text(json.dumps(result))"
)


def in_own_process(function: str, job: dict, directory: pathlib.Path) -> dict:
    """``function`` (``"module.name"`` of benchmarks/) on ``job`` in a fresh Python process that
    sees one device: the first GPU, or one CPU device (simulated ones left out)."""
    job_file = directory / f"{function}-job.json"
    result_file = directory / f"{function}-result.json"
    job_file.write_text(json.dumps(job))
    count = r"--xla_force_host_platform_device_count=\d+"
    flags = re.sub(count, "", os.environ.get("XLA_FLAGS", "")).strip()
    first_gpu = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": first_gpu, "XLA_FLAGS": flags}
    if not flags:  # XLA reads a value that is not a flag as a file of flags
        del env["XLA_FLAGS"]
    command = [sys.executable, "-c", CHILD, str(BENCHMARKS), str(job_file), str(result_file)]
    subprocess.run([*command, function], check=True, env=env)
    return json.loads(result_file.read_text())


def steady(windows: list[float]) -> float:
    """The median of the windows after the first, or the one: the peer's first warms up (its
    kernels, its allocator); ours times its first from after the compiling step, and drops it
    alike so that both medians cover the same steps."""
    return statistics.median(windows[1:] or windows)


def train_ours(job: dict) -> dict:
    """Trains ``job``'s config (``recipe``, ``overrides``) with the loop; what it logged."""
    import jax

    from flaxformer_lite.ops.attention_choice import recorded_choices
    from flaxformer_lite.process import use_compilation_cache
    from flaxformer_lite.train import loop
    from flaxformer_lite.train.config import load_config
    from flaxformer_lite.train.metrics import read_metrics
    from flaxformer_lite.train.run_dir import RunDir

    cfg = load_config(job["recipe"], job["overrides"])
    use_compilation_cache(cfg.train.compilation_cache)  # as train.py does
    with recorded_choices() as choices:
        loop.run(cfg, progress=False, log=lambda _: None)
    logged = [record for record in read_metrics(cfg.run_dir) if "tokens_per_sec" in record]
    run_cfg = load_config(RunDir(cfg.run_dir).config)  # as it ran: the tokenizer's vocabulary
    device = jax.local_devices()[0]
    stats = device.memory_stats() or {}
    peak = stats.get("peak_bytes_in_use")
    return {
        "jax": jax.__version__,
        "device": device.device_kind,
        "devices": jax.device_count(),
        "attention": "+".join(dict.fromkeys(choice.backend for choice in choices)) or "none",
        "window_tokens_per_sec": [record["tokens_per_sec"] for record in logged],
        "window_mfu": [record["mfu"] for record in logged],
        "logged_steps": [record["step"] for record in logged],
        "losses": [record["loss"] for record in logged],
        "peak_memory_bytes": peak or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "peak_memory_of": "device" if peak else "process",
        "model": {key: getattr(run_cfg.model, key) for key in PEER_MODEL_KEYS},
        "optimizer": {key: getattr(run_cfg.optimizer, key) for key in PEER_OPTIMIZER_KEYS},
        "seed": run_cfg.seed,
        "batch_size": run_cfg.train.batch_size,
        "seq_len": run_cfg.data.seq_len,
    }


def run(args) -> dict:
    summary = {"steps": args.steps, "log_every": args.log_every, "tiny": args.tiny, "models": {}}
    with tempfile.TemporaryDirectory() as scratch:
        directory = pathlib.Path(scratch)
        for name in args.models:
            recipe, overrides = MODELS[name]
            overrides = [
                *overrides,
                *(TINY.get(name, []) if args.tiny else []),
                f"run_dir={directory / name}",
                f"train.steps={args.steps}",
                f"train.log_every={args.log_every}",
                f"train.eval_every={args.steps}",
                "train.eval_batches=1",
                "train.decode_examples=0",
                "train.log_samples=0",
                f"checkpoint.every={args.steps}",
            ]
            job = {"recipe": recipe, "overrides": overrides}
            ours = in_own_process("gpu.train_ours", job, directory)
            ours |= {
                "tokens_per_sec": steady(ours["window_tokens_per_sec"]),
                # None: a device whose peak train/peak_flops.py's table does not know
                "mfu": None if None in ours["window_mfu"] else steady(ours["window_mfu"]),
            }
            result = {"ours": ours, "peer": {"skipped": "--no-hf"}}
            if not args.no_hf:
                peer_job = {
                    key: ours[key]
                    for key in ("model", "optimizer", "seed", "batch_size", "seq_len")
                }
                peer_job |= {"steps": args.steps, "log_every": args.log_every}
                try:
                    peer = in_own_process("hf_gpt2.train_bf16", peer_job, directory)
                except subprocess.CalledProcessError as error:  # out of memory, say: ours stands
                    peer = {"skipped": f"failed, exit {error.returncode}"}
                if peer["skipped"] is None:
                    peer["tokens_per_sec"] = steady(peer["window_tokens_per_sec"])
                    result["ratio"] = ours["tokens_per_sec"] / peer["tokens_per_sec"]
                    peer["mfu"] = ours["mfu"] and ours["mfu"] / result["ratio"]  # same FLOPs, peak
                result["peer"] = peer
            summary["models"][name] = result
            print(f"{name} done", file=sys.stderr, flush=True)
    return summary


def table_row(shape: str, trainer: str, run: dict) -> str:
    """A trainer's line: its device, attention, tokens/s, MFU and peak memory."""
    mfu = "n/a" if run["mfu"] is None else f"{run['mfu']:.1%}"
    memory = f"{run['peak_memory_bytes'] / 2**30:.2f}"
    if run["peak_memory_of"] == "process":
        memory += " (process)"
    cells = [shape, trainer, run["device"], run["attention"], f"{run['tokens_per_sec']:.0f}"]
    return "| " + " | ".join([*cells, mfu, memory]) + " |"


def table(summary: dict) -> list[str]:
    lines = [
        "| model | trainer | device | attention | tokens/s (median window after the first) | MFU "
        "| peak memory GiB |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, result in summary["models"].items():
        ours, peer = result["ours"], result["peer"]
        shape = f"{name} (B {ours['batch_size']}, T {ours['seq_len']})"
        lines.append(table_row(shape, f"flaxformer_lite (JAX {ours['jax']})", ours))
        if peer["skipped"] is None:
            lines.append(table_row(shape, f"GPT2LMHeadModel (torch {peer['torch']})", peer))
        else:
            lines.append(f"| {shape} | Hugging Face: skipped ({peer['skipped']}) | | | | | |")
    return lines


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--steps", type=int, default=300, help="steps of each trainer")
    parser.add_argument("--log-every", type=int, default=50, help="steps per timed window")
    parser.add_argument("--tiny", action="store_true", help="gpt2-small at a CPU's size")
    parser.add_argument("--no-hf", action="store_true", help="leave the peer out")
    return parser


def main(argv: list[str] | None = None) -> dict:
    args = parser().parse_args(argv)
    if args.steps < 2 * args.log_every or args.steps % args.log_every:
        raise SystemExit(
            "--steps must be a multiple of --log-every, at least 2 x: the first window is "
            "dropped, and both trainers time the same windows"
        )
    summary = run(args)
    for line in table(summary):
        print(line)
    for name, result in summary["models"].items():
        if "ratio" in result:
            print(f"{name}: ours / Hugging Face tokens/s = {result['ratio']:.2f}")
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    from flaxformer_lite.process import skip_absent_tpu

    skip_absent_tpu()  # as the commands do
    main()
