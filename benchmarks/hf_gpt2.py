"""The benchmarks' peer: Hugging Face transformers' ``GPT2LMHeadModel`` (PyTorch, CPU, eager) of
the shape of a flaxformer_lite GPT-2 config, generating (``generate.py``) or training
(``train_step.py``).

torch runs with ``torch.set_num_threads(os.cpu_count())`` (XLA's CPU backend uses every core too)
and ``OMP_WAIT_POLICY=PASSIVE`` unless the environment sets it: on a shared machine, OpenMP
threads spinning at barriers while another process holds a core slow torch down several times
over; passive waiting removes that and costs little on a quiet machine.
"""

from __future__ import annotations

import os

import numpy as np

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
    off; ``config``: more ``GPT2Config`` fields. Sets torch's threads to every core."""
    torch, transformers = libraries
    torch.set_num_threads(os.cpu_count())
    torch.manual_seed(seed)
    config = transformers.GPT2Config(
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
        **config,
    )
    return transformers.GPT2LMHeadModel(config)


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
