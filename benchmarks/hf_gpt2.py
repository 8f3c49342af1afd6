"""The benchmarks' peer: Hugging Face transformers' ``GPT2LMHeadModel`` (PyTorch, eager) of the
shape of a flaxformer_lite GPT-2 config, generating (``generate.py``) or training on the CPU
(``train_step.py``; ``shakespeare_char.py``, on our data pipeline's batches, in a process of its
own: this module imports no JAX) or in bfloat16 on a GPU (``gpu.py``).

torch runs with ``torch.set_num_threads(os.cpu_count())`` (XLA's CPU backend uses every core too)
and ``OMP_WAIT_POLICY=PASSIVE`` unless the environment sets it: on a shared machine, OpenMP
threads spinning at barriers while another process holds a core slow torch down several times
over; passive waiting removes that and costs little on a quiet machine.
"""

from __future__ import annotations

import math
import os
import resource
import time
from types import SimpleNamespace
from typing import TYPE_CHECKING

import numpy as np

from flaxformer_lite.data.config import DataConfig
from flaxformer_lite.data.pipeline import build_data
from flaxformer_lite.data.tasks import TASKS
from flaxformer_lite.train.run_dir import RunDir

if TYPE_CHECKING:  # annotations only: importing them would import JAX
    from flaxformer_lite.models import ModelConfig
    from flaxformer_lite.train.config import TrainConfig


def versions_line(summary: dict) -> str:
    """The first line of a benchmark's table: JAX's and (when it ran) the peer's versions."""
    line = f"jax {summary['jax']}, backend {summary['backend']}, {summary['cpu_count']} CPUs"
    if "torch" in summary:
        line += (
            f"; torch {summary['torch']} (OMP_WAIT_POLICY={summary['omp_wait_policy']}), "
            f"transformers {summary['transformers']}"
        )
    return line


def load_torch():
    """``((torch, transformers), None)``, or ``(None, the reason they cannot be used)``."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # read when torch loads OpenMP
    try:
        import torch
        import transformers
    except ImportError as error:
        return None, f"{error}"
    return (torch, transformers), None


def gpt2_model(libraries, cfg: ModelConfig, seed: int, **config):
    """A ``GPT2LMHeadModel`` of ``cfg``'s shape, its random weights drawn from ``seed``, dropout
    off; ``config``: more ``GPT2Config`` fields, or other values of these. Sets torch's threads
    to every core."""
    torch, transformers = libraries
    torch.set_num_threads(os.cpu_count())
    torch.manual_seed(seed)
    fields = dict(
        vocab_size=cfg.vocab_size,
        n_positions=cfg.max_length,
        n_embd=cfg.d_model,
        n_layer=cfg.num_decoder_layers,
        n_head=cfg.num_heads,
        n_inner=cfg.d_ff,
        activation_function="gelu_new",
        layer_norm_epsilon=cfg.norm_eps,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=None,
        eos_token_id=None,
    )
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(**fields | config))


def generate(libraries, model, prompt: np.ndarray, new_tokens: int):
    """``model.generate``, greedy with its KV cache, exactly ``new_tokens`` past ``prompt``."""
    torch, _ = libraries
    input_ids = torch.from_numpy(prompt.astype(np.int64))
    with torch.inference_mode():
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            use_cache=True,
            pad_token_id=0,
        )
    if out.shape != (prompt.shape[0], prompt.shape[1] + new_tokens):
        raise RuntimeError(
            f"Hugging Face generated {tuple(out.shape)}, expected "
            f"{(prompt.shape[0], prompt.shape[1] + new_tokens)}"
        )
    return out


class TrainStep:
    """``GPT2LMHeadModel`` + ``torch.optim.AdamW`` (``cfg.optimizer``'s learning rate, betas, eps
    and weight decay; ``clip_grad_norm_`` when it clips) on one batch; ``run(k)`` takes k steps.

    Its loss covers ``T - 1`` targets per row (the labels are shifted inside the model).
    """

    def __init__(self, libraries, cfg: TrainConfig, batch: dict[str, np.ndarray]):
        torch, _ = libraries
        self.torch = torch
        self.model = gpt2_model(libraries, cfg.model, cfg.seed).train()
        self.parameters = sum(p.numel() for p in self.model.parameters())
        o = cfg.optimizer
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(),
            lr=o.lr,
            betas=(o.b1, o.b2),
            eps=o.eps,
            weight_decay=o.weight_decay,
        )
        self.clip_norm = o.clip_norm
        self.input_ids = torch.from_numpy(batch["inputs"].astype(np.int64))
        self.losses: list[float] = []

    def run(self, steps: int) -> None:
        for _ in range(steps):
            self.optimizer.zero_grad(set_to_none=True)
            loss = self.model(self.input_ids, labels=self.input_ids).loss
            loss.backward()
            if self.clip_norm is not None:
                self.torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip_norm)
            self.optimizer.step()
        self.losses.append(loss.item())


def train_lm(job: dict) -> dict:
    """A ``GPT2LMHeadModel`` trained and evaluated on our pipeline's ``lm`` batches.

    ``job`` (JSON): ``data``, a ``DataConfig``'s fields; ``model``, the ``ModelConfig`` fields
    that :func:`gpt2_model` reads but the vocabulary (the tokenizer's); ``optimizer``, ``b1``,
    ``b2``, ``eps``, ``weight_decay`` (on every 2-D parameter) and ``clip_norm`` (None: no
    clipping); ``rates``, each step's learning rate (one per step); ``seed``, ``batch_size``,
    ``eval_every``; ``directory``, where the tokenizer and the prepared data go. Every bias is
    zeroed and frozen; the embeddings are tied. Each step trains on the pipeline's next batch:
    ``inputs``, ``targets``, ``positions`` as ``position_ids`` (transformers masks a row of
    several segments from the positions' resets, a detection it skips with a KV cache:
    ``use_cache=False``), the loss weighted by ``weights``. It evaluates on
    ``data.eval_batches()``, token-weighted, every ``eval_every`` steps and after the last.

    Returns ``{"skipped": why}`` if torch or transformers cannot be imported, else the versions,
    the trainable parameters, each step's seconds (from taking its batch to the end of its
    optimizer step), the held-out loss after each evaluation and the targets it is over.
    """
    libraries, skipped = load_torch()
    if libraries is None:
        return {"skipped": skipped}
    torch, transformers = libraries
    data = build_data(
        DataConfig(**job["data"]),
        task=TASKS["lm"],
        seed=job["seed"],
        batch_size=job["batch_size"],
        directory=RunDir(job["directory"]).tokenizer,
        prepared=RunDir(job["directory"]).prepared,
    )
    shape = SimpleNamespace(**job["model"], vocab_size=data.vocab_size)
    model = gpt2_model(libraries, shape, job["seed"]).train()
    if model.lm_head.weight is not model.transformer.wte.weight:
        raise RuntimeError("GPT2LMHeadModel's output projection is not tied to wte")
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(".bias"):
                parameter.zero_().requires_grad_(False)
    trainable = [p for p in model.parameters() if p.requires_grad]
    o = job["optimizer"]
    groups = [
        {"params": [p for p in trainable if p.dim() >= 2], "weight_decay": o["weight_decay"]},
        {"params": [p for p in trainable if p.dim() < 2], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, betas=(o["b1"], o["b2"]), eps=o["eps"])

    def summed_loss(batch):
        tensors = {key: torch.from_numpy(value) for key, value in batch.items()}
        positions = tensors.get("positions")
        logits = model(
            input_ids=tensors["inputs"].long(),
            position_ids=None if positions is None else positions.long(),
            use_cache=False,
        ).logits
        losses = torch.nn.functional.cross_entropy(
            logits.flatten(0, 1), tensors["targets"].long().flatten(), reduction="none"
        )
        weights = tensors["weights"].flatten()
        return (losses * weights).sum(), weights.sum()

    def evaluate() -> tuple[float, float]:
        model.eval()
        with torch.inference_mode():
            losses = [tuple(map(float, summed_loss(batch))) for batch in data.eval_batches()]
        model.train()
        total, count = (math.fsum(column) for column in zip(*losses, strict=True))
        return total / count, count

    seconds, eval_losses = [], {}
    for step, rate in enumerate(job["rates"], start=1):
        start = time.perf_counter()
        batch = next(data.train)
        for group in optimizer.param_groups:
            group["lr"] = rate
        total, count = summed_loss(batch)
        optimizer.zero_grad(set_to_none=True)
        (total / count).backward()
        if o["clip_norm"] is not None:
            torch.nn.utils.clip_grad_norm_(trainable, o["clip_norm"])
        optimizer.step()
        seconds.append(time.perf_counter() - start)
        if step % job["eval_every"] == 0 or step == len(job["rates"]):
            eval_losses[str(step)], targets = evaluate()
    data.train.close()
    return {
        "skipped": None,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "threads": torch.get_num_threads(),
        "parameters": sum(p.numel() for p in trainable),
        "step_seconds": seconds,
        "eval_losses": eval_losses,
        "eval_targets": targets,
    }


def train_bf16(job: dict) -> dict:
    """A ``GPT2LMHeadModel`` trained the way an accelerator user trains it: float32 weights under
    ``torch.autocast`` to bfloat16 (ours computes in bf16 on float32 parameters too), SDPA
    attention, torch's own tanh GELU, ``torch.optim.AdamW`` (fused on a GPU), eager (no
    ``torch.compile``), on a GPU when torch sees one.

    ``job`` (JSON): ``model``, the ``ModelConfig`` fields that :func:`gpt2_model` reads, with
    ``vocab_size``; ``optimizer``, ``lr``, ``b1``, ``b2``, ``eps``, ``weight_decay``,
    ``clip_norm``; ``seed``, ``batch_size``, ``seq_len``, ``steps``, ``log_every``. Every step
    trains on the same batch of random tokens, the loss over all ``seq_len`` targets of a row.

    Returns ``{"skipped": why}`` if torch or transformers cannot be imported, else the versions,
    the device, the attention implementation the model ran, the tokens/s of each window of
    ``log_every`` steps (timed until its last loss is on the host) and the peak memory: the GPU's
    ``max_memory_allocated``, or on a CPU the process's peak resident set.
    """
    libraries, skipped = load_torch()
    if libraries is None:
        return {"skipped": skipped}
    torch, transformers = libraries
    device = "cuda" if torch.cuda.is_available() else "cpu"
    shape = SimpleNamespace(**job["model"])
    # gelu_pytorch_tanh: the function of gelu_new (and ours) in one kernel instead of several
    model = gpt2_model(
        libraries,
        shape,
        job["seed"],
        attn_implementation="sdpa",
        activation_function="gelu_pytorch_tanh",
    )
    model = model.to(device).train()
    o = job["optimizer"]
    optimizer = torch.optim.AdamW(
        model.parameters(),
        lr=o["lr"],
        betas=(o["b1"], o["b2"]),
        eps=o["eps"],
        weight_decay=o["weight_decay"],
        fused=device == "cuda",
    )
    generator = torch.Generator().manual_seed(job["seed"])
    size = (job["batch_size"], job["seq_len"] + 1)
    tokens = torch.randint(0, shape.vocab_size, size, generator=generator).to(device)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]

    def step():
        with torch.autocast(device_type=device, dtype=torch.bfloat16):
            logits = model(input_ids=inputs, use_cache=False).logits
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if o["clip_norm"] is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), o["clip_norm"])
        optimizer.step()
        return loss

    window_tokens_per_sec, losses = [], []
    for _ in range(job["steps"] // job["log_every"]):
        start = time.perf_counter()
        for _ in range(job["log_every"]):
            loss = step()
        losses.append(loss.item())  # waits for the window's last step
        seconds = time.perf_counter() - start
        window_tokens_per_sec.append(job["log_every"] * inputs.numel() / seconds)
    if device == "cuda":
        peak, name = torch.cuda.max_memory_allocated(), torch.cuda.get_device_name()
    else:
        peak, name = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "cpu"
    return {
        "skipped": None,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": name,
        "attention": model.config._attn_implementation,
        "parameters": sum(p.numel() for p in model.parameters()),
        "window_tokens_per_sec": window_tokens_per_sec,
        "losses": losses,
        "peak_memory_bytes": peak,
        "peak_memory_of": "device" if device == "cuda" else "process",
    }
