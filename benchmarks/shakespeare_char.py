"""nanoGPT's CPU recipe for Tiny Shakespeare through three trainers in one run: held-out loss,
wall time and tokens/s of ours, of Hugging Face's GPT-2 on PyTorch and of nanoGPT itself.

    python benchmarks/shakespeare_char.py                          # ours and Hugging Face's
    python benchmarks/shakespeare_char.py --nanogpt ~/nanoGPT      # and nanoGPT's train.py
    python benchmarks/shakespeare_char.py --steps 200 --skip-torch # ours alone, shortened
    python benchmarks/shakespeare_char.py --seeds 5                # ours' mean over 5 seeds

The recipe (nanoGPT's README, CPU section; ``configs/shakespeare_char.yaml``): a character-level
GPT of 4 layers, 4 heads, width 128, context 64, batch 12, 2000 steps (``--steps``), AdamW lr 1e-3
with 100 warmup steps and cosine decay to 1e-4, beta2 0.99, weight decay 0.1 on every 2-D
parameter (embeddings included), no dropout, no biases, tied embeddings. The text is the config's
(``builtin:tinyshakespeare``, 1,115,394 characters): the first 90% trains, the last 10% is held
out, as nanoGPT's ``data/shakespeare_char/prepare.py`` splits it. The trainers run one after
another (a shared machine's speed drifts between them; tokens/s of one trainer are steadier than
the ratios across trainers):

- ours: ``train.py --config CONFIG run_dir=<temp> train.steps=STEPS --no-progress``, a
  subprocess. The config makes the file one document and trains on ``windows`` of it.
- our step alone: the jitted train step that the loop compiles for this config (a short run of
  the loop in this process, ``loop_vs_step.LoopRun``), timed on the run's last batch in a window
  of ``STEP_WINDOW`` steps right before and one right after ``train.py``'s run, so that the
  machine's drift hits both; train.py's logged steady tokens/s over the step's (the mean seconds
  per step of the two windows) must be >= 95%.
- ours over seeds: ``flaxformer-lite sweep --config CONFIG --vary seed=0,...,N-1
  train.steps=STEPS`` (``--seeds`` N, 3), a subprocess: the recipe's N seeds as one compiled
  program, each member a run like the one above (its seed 0 is that run's config), their final
  ``eval_loss`` as mean ± sample standard deviation (the sweep's summary in ``sweep.json``). Its
  tokens/s is the program's: every member logs the same rate, its program's per member, so
  members x a member's steady rate.
- Hugging Face: ``GPT2LMHeadModel`` (``hf_gpt2.train_lm``: PyTorch eager, every core,
  ``OMP_WAIT_POLICY=PASSIVE`` unless set) of the same shape, our tokenizer's vocabulary,
  dropout 0, tied embeddings, every Conv1D and LayerNorm bias zeroed and frozen
  (``requires_grad=False``); ``torch.optim.AdamW`` with our betas and eps, weight decay 0.1 on
  every 2-D parameter, our schedule's learning rate at each step, gradients clipped as ours. It
  trains on the very batches our pipeline makes (``build_data`` on the same config):
  ``inputs``, ``targets``, ``positions`` as ``position_ids``, the loss weighted by ``weights``
  (a row of several segments is masked by transformers' own packed-sequence detection from the
  positions' resets, which it skips with a KV cache: ``use_cache=False``). It evaluates at the
  config's ``train.eval_every`` steps and at the end, as ``train.py`` does. It runs in a Python
  process of its own, which imports our data pipeline but not JAX: in this process, which ran
  the loop, torch would share the process with XLA's threads and glibc's settings for JAX, and
  it was imported (by tensorboardX) before ``OMP_WAIT_POLICY`` could be set, so its OpenMP
  threads spun at every barrier; on this loaded 2-core machine a step then took up to 50 times
  longer. Skipped by ``--skip-torch``, or with a line saying why when torch or transformers
  cannot be imported.
- nanoGPT (``--nanogpt DIR``, a checkout; never written to): its ``train.py``, ``model.py``,
  ``configurator.py``, its config and its ``prepare.py`` are copied into a temporary directory,
  where the config's text becomes ``data/shakespeare_char/input.txt`` (so ``prepare.py``
  downloads nothing) and ``prepare.py`` writes ``train.bin``, ``val.bin`` and ``meta.pkl`` (65
  characters). Then the README's CPU command, ``python train.py config/train_shakespeare_char.py
  --device=cpu --compile=False --eval_iters=20 --log_interval=1 --block_size=64 --batch_size=12
  --n_layer=4 --n_head=4 --n_embd=128 --max_iters=STEPS --lr_decay_iters=STEPS --dropout=0.0``,
  plus ``--always_save_checkpoint=True`` and ``--out_dir`` in the temporary directory (and
  ``--eval_interval=STEPS`` when STEPS is not a multiple of its 250, so that a checkpoint is
  written after the last update), with this Python and ``OMP_WAIT_POLICY=PASSIVE`` unless set.
  Its checkpoint at iteration STEPS holds the model after STEPS updates (nanoGPT evaluates and
  saves before an iteration's update, then takes one more update that it does not save).

Held-out loss, each over every held-out character, token-weighted, from the final model:

- ours: the last ``eval_loss`` that ``train.py`` logs (``<run_dir>/metrics.jsonl``): its held-out
  tail of the document in pieces of 64 positions from its start, each piece its own segment
  from position 0 (so the first target of a piece has one token of context, the last 64);
  the first piece begins with ``<sos>`` and the last ends with an ``<eos>`` target. It is
  checked by evaluating the run's final checkpoint (``load_run``) over the same batches as the
  Hugging Face peer.
- Hugging Face: ``data.eval_batches()`` of our pipeline, the same pieces as ours.
- nanoGPT: its checkpoint loaded with the checkout's ``model.py``, over ``val.bin`` in
  non-overlapping windows of 64 inputs, each window's targets its inputs shifted by one: every
  held-out character but the first is a target once, with the same 1 to 64 tokens of context.
  nanoGPT's own logged ``val loss`` (20 random batches) is in the JSON only.

The table gives the number of targets each loss is over; they differ by the ``<sos>``-predicted
first character and the ``<eos>`` target of ours.

Wall seconds: each trainer's process from launch to exit: start-up and imports (Hugging Face's:
torch, transformers and our data pipeline), data preparation (not nanoGPT's ``prepare.py``,
timed apart), the model, compilation (ours), training and every evaluation.

Steady tokens/s (``batch_size * seq_len`` tokens per step): the median over windows of
``train.log_every`` (100) training steps of their tokens/s, leaving out the first window (it
holds the compiling or warming-up steps) when there are others, and the time of evaluations
and checkpoints: for ours the logged ``tokens_per_sec`` (the loop times each window so), for
Hugging Face each step timed from taking its batch to the end of its optimizer step, for
nanoGPT its per-iteration ``time Xms`` lines without the iterations that evaluated.

Printed: a versions line, the table, ours' val loss over seeds and each member's, train.py's
share of the step alone, the ratio of our wall time to nanoGPT's and to Hugging Face's, a
PASS/FAIL line for the 95% target and, as the last line, one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import json
import math
import os
import pathlib
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from flaxformer_lite.data import readers
from flaxformer_lite.data.pipeline import build_data
from flaxformer_lite.data.tasks import TASKS
from flaxformer_lite.process import reuse_freed_host_memory, skip_absent_tpu
from flaxformer_lite.train.config import TrainConfig, load_config
from flaxformer_lite.train.metrics import read_metrics
from flaxformer_lite.train.optim import make_schedule
from flaxformer_lite.train.run_dir import RunDir
from flaxformer_lite.train.step import model_loss
from flaxformer_lite.train.trained_run import load_run

import hf_gpt2
from loop_vs_step import LoopRun, paired_shares, short_run_overrides

BENCHMARKS = pathlib.Path(__file__).resolve().parent
REPO = BENCHMARKS.parent
CONFIG = REPO / "configs" / "shakespeare_char.yaml"
SHARE_TARGET = 0.95  # train.py's logged steady tokens/s over its step alone's
STEP_WINDOW = 200  # steps of each timed window of the step alone
STEP_RUN_STEPS = 5  # the short run of the loop that compiles the step: 2 x this many steps
# The Hugging Face peer's process: benchmarks/ on its path, the job's file, the result's file.
PEER_PROCESS = (
    "import json, pathlib, sys; sys.path.insert(0, sys.argv[1]); import hf_gpt2; "
    "job = json.loads(pathlib.Path(sys.argv[2]).read_text()); "
    "pathlib.Path(sys.argv[3]).write_text(json.dumps(hf_gpt2.train_lm(job)))"
)
PEER_MODEL_KEYS = ("d_model", "num_heads", "d_ff", "num_decoder_layers", "max_length", "norm_eps")
PEER_OPTIMIZER_KEYS = ("b1", "b2", "eps", "weight_decay", "clip_norm")
# nanoGPT's files that its train.py needs, and its README's CPU command (steps appended).
NANOGPT_FILES = (
    "train.py",
    "model.py",
    "configurator.py",
    "config/train_shakespeare_char.py",
    "data/shakespeare_char/prepare.py",
)
NANOGPT_DATA = pathlib.Path("data", "shakespeare_char")
NANOGPT_COMMAND = [
    "train.py",
    "config/train_shakespeare_char.py",
    "--device=cpu",
    "--compile=False",
    "--eval_iters=20",
    "--log_interval=1",
    "--block_size=64",
    "--batch_size=12",
    "--n_layer=4",
    "--n_head=4",
    "--n_embd=128",
]
NANOGPT_EVAL_INTERVAL = 250  # config/train_shakespeare_char.py's
NANOGPT_ITERATION = re.compile(r"^iter (\d+): loss [-\d.naif]+, time ([\d.]+)ms", re.M)
NANOGPT_VAL = re.compile(r"^step (\d+): train loss [\d.]+, val loss ([\d.]+)$", re.M)
NANOGPT_TOKENS_PER_STEP = 12 * 64
NANOGPT_EVAL_ROWS = 64  # windows per forward pass of nanoGPT's held-out evaluation
FLAXFORMER_LITE = "import sys; from flaxformer_lite.cli import main; sys.exit(main())"


def parser() -> argparse.ArgumentParser:
    """The command line of this benchmark (tests/test_readme.py parses the documented commands)."""
    command_line = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    command_line.add_argument("--steps", type=int, default=2000, help="training steps of each")
    command_line.add_argument(
        "--nanogpt", type=pathlib.Path, help="a nanoGPT checkout: also run its train.py"
    )
    command_line.add_argument(
        "--skip-torch", action="store_true", help="skip the Hugging Face peer (PyTorch)"
    )
    command_line.add_argument(
        "--seeds", type=int, default=3, help="seeds of ours' sweep (its val loss's mean ± std)"
    )
    command_line.add_argument(
        "--config",
        type=pathlib.Path,
        default=CONFIG,
        help="ours' config (default: configs/shakespeare_char.yaml)",
    )
    return command_line


def recipe_config(args, run_dir: pathlib.Path, extra: dict | None = None) -> TrainConfig:
    """``--config`` for ``--steps`` steps in ``run_dir``, then the ``extra`` overrides."""
    overrides = {"run_dir": run_dir, "train.steps": args.steps} | (extra or {})
    return load_config(args.config, [f"{key}={value}" for key, value in overrides.items()])


def window_tokens_per_sec(
    seconds: dict[int, float], tokens_per_step: int, window: int
) -> list[float]:
    """Tokens/s of each window of ``window`` consecutive steps, from each step's seconds (steps
    left out, such as evaluating ones, leave their window shorter)."""
    windows: dict[int, list[float]] = {}
    for step, step_seconds in sorted(seconds.items()):
        windows.setdefault(step // window, []).append(step_seconds)
    return [tokens_per_step * len(times) / sum(times) for times in windows.values()]


def steady(tokens_per_sec: list[float]) -> float:
    """The median of windows' tokens/s, the first (compiling, warming up) left out if others."""
    return statistics.median(tokens_per_sec[1:] or tokens_per_sec)


def token_weighted(losses: list[tuple[float, float]]) -> tuple[float, float]:
    """``(loss, targets)`` from ``(loss summed over targets, targets)`` of batches."""
    total, count = map(math.fsum, zip(*losses, strict=True))
    return total / count, count


# ----------------------------------------------------------------------------- ours
def train_py(args, run_dir: pathlib.Path) -> float:
    """Trains ``--config`` in ``run_dir`` in a ``train.py`` subprocess; its wall seconds."""
    command = [sys.executable, str(REPO / "train.py"), "--config", str(args.config)]
    command += [f"run_dir={run_dir}", f"train.steps={args.steps}", "--no-progress"]
    started = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - started


def evaluate_run(run_dir: pathlib.Path, cfg: TrainConfig) -> dict:
    """The run's final checkpoint over ``data.eval_batches()`` of the run's data (its saved
    tokenizer), token-weighted; and its parameter count."""
    run = load_run(run_dir)
    graphdef, state = nnx.split(run.model)

    @jax.jit
    def summed(state, batch):
        _, metrics = model_loss(nnx.merge(graphdef, state), batch, task=TASKS["lm"])
        return metrics["loss"] * metrics["num_tokens"], metrics["num_tokens"]

    data = build_data(
        cfg.data,
        task=TASKS["lm"],
        seed=cfg.seed,
        batch_size=cfg.train.batch_size,
        directory=RunDir(run_dir).tokenizer,
        prepared=RunDir(run_dir).prepared,
        prefetch=0,
    )
    losses = [tuple(map(float, summed(state, batch))) for batch in data.eval_batches()]
    loss, targets = token_weighted(losses)
    parameters = sum(x.size for x in jax.tree.leaves(nnx.state(run.model, nnx.Param)))
    return {"eval_loss_checkpoint": loss, "eval_targets": targets, "parameters": parameters}


def ours(args, directory: pathlib.Path) -> dict:
    """train.py's run, its logged loss and tokens/s, and the step alone timed around it."""
    step_cfg = recipe_config(
        args, directory / "step", short_run_overrides(directory / "step", STEP_RUN_STEPS)
    )
    loop_run = LoopRun(step_cfg)  # compiles the loop's step; its batch is the recipe's
    warmup = STEP_WINDOW // 5
    between = [loop_run.seconds_per_step(STEP_WINDOW, warmup)]
    run_dir = directory / "ours"
    wall = train_py(args, run_dir)
    between.append(loop_run.seconds_per_step(STEP_WINDOW, warmup))
    cfg = recipe_config(args, run_dir)
    records = read_metrics(run_dir)
    logged = [r["tokens_per_sec"] for r in records if r.get("tokens_per_sec")]
    tokens_per_step = cfg.train.batch_size * cfg.data.seq_len
    (share,) = paired_shares([steady(logged)], between, tokens_per_step)
    return {
        "wall_seconds": wall,
        "eval_loss": [r["eval_loss"] for r in records if "eval_loss" in r][-1],
        "logged_tokens_per_sec": logged,
        "tokens_per_sec": steady(logged),
        "step_seconds": between,
        "step_tokens_per_sec": tokens_per_step * 2 / sum(between),
        "share": share,
        **evaluate_run(run_dir, cfg),
    }


def seeds(args, directory: pathlib.Path) -> dict:
    """``--seeds`` seeds of ours trained by one ``flaxformer-lite sweep`` subprocess, timed from
    launch to exit: each member's final eval loss, their mean ± std, the program's tokens/s."""
    sweep_dir = directory / "sweep"
    command = [sys.executable, "-c", FLAXFORMER_LITE, "sweep", "--config", str(args.config)]
    command += ["--vary", "seed=" + ",".join(map(str, range(args.seeds)))]
    command += [f"run_dir={sweep_dir}", f"train.steps={args.steps}"]
    started = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - started
    summary = json.loads((sweep_dir / "sweep.json").read_text())["summary"]
    (group,) = summary["groups"].values()  # the members differ only in their seed
    results = {name: member["results"] for name, member in summary["members"].items()}
    first = read_metrics(sweep_dir / next(iter(results)))
    logged = [r["tokens_per_sec"] for r in first if r.get("tokens_per_sec")]
    return {
        "wall_seconds": wall,
        "members": {name: member["eval_loss"] for name, member in results.items()},
        "eval_loss": group["eval_loss"],
        "eval_targets": next(iter(results.values()))["eval_tokens"],
        "tokens_per_sec": args.seeds * steady(logged),
    }


# ----------------------------------------------------------------------------- Hugging Face
def hugging_face(args, directory: pathlib.Path) -> dict:
    """Trains and evaluates the Hugging Face peer (``hf_gpt2.train_lm``) on the config's
    pipeline, with our schedule's learning rates, in a Python process of its own timed from
    launch to exit; ``{"skipped": why}`` when torch or transformers cannot be imported."""
    cfg = recipe_config(args, directory / "hf")
    o = cfg.optimizer
    schedule = make_schedule(
        o, total_steps=o.schedule_steps or cfg.train.steps, d_model=cfg.model.d_model
    )
    job = {
        "data": dataclasses.asdict(cfg.data),
        "model": {key: getattr(cfg.model, key) for key in PEER_MODEL_KEYS},
        "optimizer": {key: getattr(o, key) for key in PEER_OPTIMIZER_KEYS},
        "rates": np.asarray(jax.vmap(schedule)(jnp.arange(cfg.train.steps))).tolist(),
        "seed": cfg.seed,
        "batch_size": cfg.train.batch_size,
        "eval_every": cfg.train.eval_every,
        "directory": str(directory / "hf"),
    }
    job_file, result_file = directory / "hf-job.json", directory / "hf-result.json"
    job_file.write_text(json.dumps(job))
    command = [sys.executable, "-c", PEER_PROCESS, str(BENCHMARKS), str(job_file), str(result_file)]
    started = time.perf_counter()
    subprocess.run(command, check=True)
    wall = time.perf_counter() - started
    result = json.loads(result_file.read_text())
    if result["skipped"] is not None:
        return result
    seconds = dict(enumerate(result.pop("step_seconds")))
    tokens_per_step = cfg.train.batch_size * cfg.data.seq_len
    logged = window_tokens_per_sec(seconds, tokens_per_step, cfg.train.log_every)
    return result | {
        "wall_seconds": wall,
        "eval_loss": result["eval_losses"][str(cfg.train.steps)],
        "window_tokens_per_sec": logged,
        "tokens_per_sec": steady(logged),
    }


# ----------------------------------------------------------------------------- nanoGPT
def nanogpt_copy(checkout: pathlib.Path, text: str, directory: pathlib.Path) -> pathlib.Path:
    """The files nanoGPT's train.py needs, copied from ``checkout`` into ``directory``, with
    ``text`` as its ``input.txt`` and its ``prepare.py`` run there; returns the copy."""
    copy = directory / "nanogpt"
    for name in NANOGPT_FILES:
        (copy / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(checkout / name, copy / name)
    (copy / NANOGPT_DATA / "input.txt").write_text(text)
    return copy


def nanogpt_eval_interval(steps: int) -> int:
    """nanoGPT's config's ``eval_interval``, or ``steps`` if that is not a multiple of it: an
    evaluation, and so a checkpoint, follows the last update."""
    return NANOGPT_EVAL_INTERVAL if steps % NANOGPT_EVAL_INTERVAL == 0 else steps


def nanogpt_arguments(steps: int, out_dir: pathlib.Path) -> list[str]:
    """The arguments of nanoGPT's README's CPU command for ``steps`` steps, every evaluation
    saved to ``out_dir``."""
    arguments = [*NANOGPT_COMMAND, f"--max_iters={steps}", f"--lr_decay_iters={steps}"]
    arguments += ["--dropout=0.0", "--always_save_checkpoint=True", f"--out_dir={out_dir}"]
    if nanogpt_eval_interval(steps) != NANOGPT_EVAL_INTERVAL:
        arguments.append(f"--eval_interval={steps}")
    return arguments


def nanogpt_log(stdout: str, steps: int) -> tuple[dict[int, float], dict[str, float]]:
    """From nanoGPT's train.py output: the seconds of each iteration that did not evaluate (its
    ``time`` counts the evaluation and checkpoint at its start), and the logged val losses."""
    interval = nanogpt_eval_interval(steps)
    seconds = {
        int(it): float(ms) / 1e3
        for it, ms in NANOGPT_ITERATION.findall(stdout)
        if int(it) % interval
    }
    return seconds, {it: float(loss) for it, loss in NANOGPT_VAL.findall(stdout)}


def nanogpt(args, cfg: TrainConfig, directory: pathlib.Path) -> dict:
    """Prepares nanoGPT's data in a copy of ``--nanogpt``, runs its train.py there, and
    evaluates its last checkpoint over every held-out character (module docstring)."""
    (path,) = readers.expand_files(cfg.data.path)
    copy = nanogpt_copy(args.nanogpt, readers.read_text(path), directory)
    environment = {"OMP_WAIT_POLICY": "PASSIVE"} | dict(os.environ)
    prepare = [sys.executable, str(NANOGPT_DATA / "prepare.py")]
    started = time.perf_counter()
    subprocess.run(prepare, cwd=copy, env=environment, check=True, stdout=subprocess.DEVNULL)
    prepare_seconds = time.perf_counter() - started
    out_dir = directory / "nanogpt-out"
    arguments = nanogpt_arguments(args.steps, out_dir)
    started = time.perf_counter()
    finished = subprocess.run(
        [sys.executable, *arguments],
        cwd=copy,
        env=environment,
        check=True,
        stdout=subprocess.PIPE,
        text=True,
    )
    wall = time.perf_counter() - started
    seconds, val_losses = nanogpt_log(finished.stdout, args.steps)
    logged = window_tokens_per_sec(seconds, NANOGPT_TOKENS_PER_STEP, cfg.train.log_every)
    return {
        "command": " ".join(arguments),
        "prepare_seconds": prepare_seconds,
        "wall_seconds": wall,
        "logged_val_losses": val_losses,
        "window_tokens_per_sec": logged,
        "tokens_per_sec": steady(logged),
        **nanogpt_evaluation(copy, out_dir / "ckpt.pt", args.steps),
    }


def held_out_windows(ids: np.ndarray, block: int, rows: int) -> list[np.ndarray]:
    """``ids`` in non-overlapping windows of ``block`` inputs, each with its ``block`` targets
    (the inputs shifted by one: ``block + 1`` ids), in batches of ``rows`` windows; the last
    window, shorter if ``len(ids) - 1`` is not a multiple of ``block``, is a batch alone. Every
    id but the first is a target once."""
    windows = [ids[s : s + block + 1] for s in range(0, len(ids) - 1, block)]
    full = [window for window in windows if len(window) == block + 1]
    batches = [np.stack(full[i : i + rows]) for i in range(0, len(full), rows)]
    return batches + [window[None] for window in windows if len(window) <= block]


def nanogpt_evaluation(copy: pathlib.Path, checkpoint: pathlib.Path, steps: int) -> dict:
    """nanoGPT's checkpoint over ``val.bin`` in non-overlapping windows of its block size."""
    import torch  # nanoGPT alone needs it here: imported only with --nanogpt

    spec = importlib.util.spec_from_file_location("nanogpt_model", copy / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    saved = torch.load(checkpoint, map_location="cpu", weights_only=True)
    if saved["iter_num"] != steps:
        raise RuntimeError(f"{checkpoint} is from iteration {saved['iter_num']}, not {steps}")
    with contextlib.redirect_stdout(sys.stderr):  # its parameter count
        model = module.GPT(module.GPTConfig(**saved["model_args"]))
    model.load_state_dict(saved["model"])
    model.eval()
    torch.set_num_threads(os.cpu_count())
    ids = np.fromfile(copy / NANOGPT_DATA / "val.bin", np.uint16).astype(np.int64)
    block = saved["model_args"]["block_size"]
    losses = []
    with torch.inference_mode():
        for rows in held_out_windows(ids, block, NANOGPT_EVAL_ROWS):
            x, y = torch.from_numpy(rows[:, :-1].copy()), torch.from_numpy(rows[:, 1:].copy())
            _, loss = model(x, y)  # the mean over the batch's targets
            losses.append((float(loss) * y.numel(), y.numel()))
    loss, targets = token_weighted(losses)
    return {
        "parameters": sum(p.numel() for p in model.parameters()),
        "eval_loss": loss,
        "eval_targets": targets,
    }


# ----------------------------------------------------------------------------- the benchmark
def run(args) -> dict:
    with tempfile.TemporaryDirectory() as scratch:
        scratch = pathlib.Path(scratch)
        cfg = recipe_config(args, scratch / "ours")
        summary = {
            "jax": jax.__version__,
            "python": platform.python_version(),
            "cpu_count": os.cpu_count(),
            "backend": jax.default_backend(),
            "config": str(args.config),
            "steps": args.steps,
            "batch_size": cfg.train.batch_size,
            "seq_len": cfg.data.seq_len,
            "ours": ours(args, scratch),
        }
        print("ours done", file=sys.stderr, flush=True)
        summary["seeds"] = seeds(args, scratch)
        print("ours' seeds done", file=sys.stderr, flush=True)
        if args.skip_torch:
            summary["hf"] = {"skipped": "--skip-torch"}
        else:
            summary["hf"] = hugging_face(args, scratch)
            print("Hugging Face done", file=sys.stderr, flush=True)
            for key in ("torch", "transformers", "omp_wait_policy"):
                if key in summary["hf"]:
                    summary[key] = summary["hf"][key]
        summary["nanogpt"] = None
        if args.nanogpt is not None:
            summary["nanogpt"] = nanogpt(args, cfg, scratch)
    return summary


def table(s: dict) -> list[str]:
    def row(name, trainer, parameters="-", loss="-", targets="-", wall="-"):
        if "eval_loss" in trainer:
            loss = trainer["eval_loss"]  # over seeds: {"mean", "std", "n"}
            loss = spread(loss) if isinstance(loss, dict) else f"{loss:.4f}"
            parameters = f"{trainer['parameters']:,}"
            targets, wall = f"{trainer['eval_targets']:,.0f}", f"{trainer['wall_seconds']:.1f}"
        rate = trainer["tokens_per_sec"]
        return f"| {name} | {parameters} | {loss} | {targets} | {wall} | {rate / 1e3:.1f}k |"

    lines = [
        "| trainer | parameters | val loss | held-out targets | wall s | steady tokens/s |",
        "|---|---|---|---|---|---|",
        row("flaxformer_lite train.py (JAX)", s["ours"]),
        row(
            f"flaxformer_lite sweep, {s['seeds']['eval_loss']['n']} seeds (JAX)",
            s["seeds"] | {"parameters": s["ours"]["parameters"]},  # the same model
        ),
        row(
            "flaxformer_lite train step alone (JAX)",
            {"tokens_per_sec": s["ours"]["step_tokens_per_sec"]},
        ),
    ]
    if s["hf"]["skipped"] is None:
        lines.append(row("Hugging Face GPT2LMHeadModel (PyTorch eager)", s["hf"]))
    if s["nanogpt"] is not None:
        lines.append(row("nanoGPT train.py (PyTorch eager)", s["nanogpt"]))
    return lines


def spread(stats: dict) -> str:
    """``mean ± std`` (the std ``-`` for one seed)."""
    std = "-" if stats["std"] is None else f"{stats['std']:.4f}"
    return f"{stats['mean']:.4f} ± {std}"


def notes(s: dict) -> list[str]:
    o = s["ours"]
    members = ", ".join(f"{name} {loss:.4f}" for name, loss in s["seeds"]["members"].items())
    lines = [
        f"ours: logged eval_loss {o['eval_loss']:.4f}, its final checkpoint re-evaluated "
        f"{o['eval_loss_checkpoint']:.4f}",
        f"ours over {s['seeds']['eval_loss']['n']} seeds (the sweep): eval_loss "
        f"{spread(s['seeds']['eval_loss'])} (mean ± std); {members}",
        f"train.py logged / step alone: {100 * o['share']:.1f}% (steady logged tokens/s over "
        "the step's, timed right before and after the run)",
    ]
    for key, name in (("nanogpt", "nanoGPT"), ("hf", "Hugging Face")):
        peer = s[key]
        if peer is not None and peer.get("skipped") is None:
            lines.append(f"our wall / {name} wall: {o['wall_seconds'] / peer['wall_seconds']:.2f}x")
        elif peer is not None:
            lines.append(f"{name} skipped: {peer['skipped']}")
    if s["nanogpt"] is not None:
        lines.append(
            f"nanoGPT's prepare.py: {s['nanogpt']['prepare_seconds']:.1f} s (not in its wall)"
        )
    return lines


def checks(s: dict) -> list[str]:
    share = s["ours"]["share"]
    return [
        f"{'PASS' if share >= SHARE_TARGET else 'FAIL'}: train.py's logged steady tokens/s = "
        f"{100 * share:.1f}% of its train step alone's >= {100 * SHARE_TARGET:.0f}%"
    ]


def main(argv=None) -> dict:
    command_line = parser()
    args = command_line.parse_args(argv)
    if args.steps < 1 or args.seeds < 1:
        command_line.error("--steps and --seeds must be positive")
    if args.nanogpt is not None:
        if args.skip_torch:
            command_line.error("--nanogpt runs PyTorch: drop --skip-torch")
        missing = [name for name in NANOGPT_FILES if not (args.nanogpt / name).is_file()]
        if missing:
            command_line.error(
                f"--nanogpt {args.nanogpt}: not a nanoGPT checkout (no {missing[0]})"
            )
    summary = run(args)
    print(hf_gpt2.versions_line(summary))
    print(
        f"{args.config.name}: {summary['steps']} steps of {summary['batch_size']} x "
        f"{summary['seq_len']} characters"
    )
    print()
    print("\n".join(table(summary)))
    print()
    print("\n".join(notes(summary)))
    print("\n".join(checks(summary)))
    print(json.dumps(summary), flush=True)
    return summary


if __name__ == "__main__":
    skip_absent_tpu()  # as the commands do
    reuse_freed_host_memory()  # as train.py does, before JAX starts its backend
    main()
