"""``flaxformer-lite generate`` and ``python sample.py``: continue prompts (decoder LM runs) or
translate inputs (encoder-decoder runs) with a trained run's newest checkpoint and tokenizer.

    flaxformer-lite generate --run_dir runs/default --prompt "12+34="
    python sample.py --run_dir runs/default --prompt "7-2=" --temperature 0.8 --num_samples 3
    flaxformer-lite generate --run_dir runs/translate --prompt "forty-two" --beam_size 4 --n_best 2
"""

from __future__ import annotations

import argparse
import pathlib

import jax
import numpy as np

from flaxformer_lite.data.tokenizers import EOS_ID, PAD_ID, SOS_ID
from flaxformer_lite.decode import beam_search, generate, right_pad, seq2seq_generate, until_eos
from flaxformer_lite.models import DecoderLM, EncoderDecoder


def parser(prog: str = "flaxformer-lite generate") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="continue prompts (decoder LM runs) or translate them (encoder-decoder "
        "runs) with a trained run",
    )
    p.add_argument("--run_dir", type=pathlib.Path, required=True, help="a train.py run directory")
    p.add_argument("--prompt", action="append", required=True,
                   help="text to continue or translate (repeat for several)")  # fmt: skip
    p.add_argument("--max_new_tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the default)")
    p.add_argument("--top_k", type=int, default=None)
    p.add_argument("--top_p", type=float, default=None)
    p.add_argument("--num_samples", type=int, default=1, help="samples per prompt")
    p.add_argument("--seed", type=int, default=0, help="the sampling key")
    p.add_argument("--beam_size", type=int, default=1,
                   help="encoder-decoder runs: beam search with this many beams")  # fmt: skip
    p.add_argument("--alpha", type=float, default=0.6, help="beam search length penalty")
    p.add_argument("--n_best", type=int, default=1, help="beam search: hypotheses to print")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: newest)")
    return p


def run(args: argparse.Namespace, say=print) -> int:
    """Loads the run and prints one block per prompt (and sample)."""
    from flaxformer_lite.train.restore import load_run

    if args.n_best > args.beam_size:
        raise ValueError(f"--n_best ({args.n_best}) cannot exceed --beam_size ({args.beam_size})")
    loaded = load_run(args.run_dir, step=args.step)
    model, tokenizer = loaded.model, loaded.tokenizer
    if not isinstance(model, DecoderLM | EncoderDecoder):
        raise ValueError(f"{args.run_dir} holds a {type(model).__name__}; generate needs a "
                         "DecoderLM or EncoderDecoder run")  # fmt: skip
    prompts = [p for p in args.prompt for _ in range(args.num_samples)]
    rng = jax.random.key(args.seed) if args.temperature > 0 else None
    sampling = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, rng=rng)
    max_length = model.config.max_length
    if isinstance(model, DecoderLM):
        rows = [[SOS_ID, *tokenizer.encode(p)] for p in prompts]
        batch, lengths = right_pad(rows, PAD_ID)
        new = min(args.max_new_tokens, max_length - batch.shape[1])
        if new < 1:
            raise ValueError(f"a prompt of {batch.shape[1]} tokens leaves no room below "
                             f"max_length={max_length}")  # fmt: skip
        out = np.asarray(generate(model, batch, max_new_tokens=new, prompt_lengths=lengths,
                                  eos_id=EOS_ID, pad_id=PAD_ID, **sampling))  # fmt: skip
        for prompt, row, n in zip(prompts, out, lengths, strict=True):
            say(f"{prompt}{tokenizer.decode(until_eos(row[n:], EOS_ID))}")
        return 0
    rows = [[*tokenizer.encode(p)[: max_length - 1], EOS_ID] for p in prompts]
    batch, lengths = right_pad(rows, PAD_ID)
    new = min(args.max_new_tokens, max_length - 1)
    common = dict(max_new_tokens=new, src_lengths=lengths, sos_id=SOS_ID, eos_id=EOS_ID,
                  pad_id=PAD_ID)  # fmt: skip
    if args.beam_size > 1:
        tokens, scores = beam_search(model, batch, beam_size=args.beam_size, alpha=args.alpha,
                                     **common)  # fmt: skip
        for prompt, beams, beam_scores in zip(prompts, np.asarray(tokens), np.asarray(scores),
                                              strict=True):  # fmt: skip
            say(prompt)
            for beam, score in list(zip(beams, beam_scores, strict=True))[: args.n_best]:
                say(f"  {score:9.4f}  {tokenizer.decode(until_eos(beam, EOS_ID))}")
        return 0
    out = np.asarray(seq2seq_generate(model, batch, **common, **sampling))
    for prompt, row in zip(prompts, out, strict=True):
        say(f"{prompt} -> {tokenizer.decode(until_eos(row, EOS_ID))}")
    return 0
