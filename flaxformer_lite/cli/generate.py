"""``flaxformer-lite generate`` and ``python sample.py``: continue prompts (decoder LMs) or
translate inputs (encoder-decoders) with a trained run's newest checkpoint and tokenizer, or with
a Hugging Face checkpoint directory and its own tokenizer.

    flaxformer-lite generate --run-dir runs/default --prompt "012+034="
    python sample.py --run-dir runs/default --prompt "007-002=" --temperature 0.8 --num-samples 3
    flaxformer-lite generate --run-dir runs/translate --prompt "forty-two" --beam-size 4 --n-best 2
    flaxformer-lite generate --hf-dir path/to/gpt2 --prompt "Hello, my name is"

The command reads its flags, loads the model and tokenizer, and prints; the prompts, the decoding
and the cut at ``eos`` are :mod:`flaxformer_lite.decode.text`'s. A run's prompts start with
``<sos>`` (as its training rows did); a Hugging Face checkpoint's start with its ``bos`` only when
its tokenizer adds one (``HfTokenizer.add_bos``: Llama yes, GPT-2 no); Marian decodes from its
``decoder_start_token_id`` (its pad), the tokenizer's ``sos_id``.
"""

from __future__ import annotations

import argparse
import pathlib

from flaxformer_lite.cli.errors import guarded, notice, say
from flaxformer_lite.cli.flags import CommandParser, add_trust_code
from flaxformer_lite.cli.library_log import library_log_to


def generate_main(argv: list[str] | None = None, prog: str = "flaxformer-lite generate") -> int:
    """``flaxformer-lite generate`` / ``sample.py``: continue or translate prompts with a run or a
    Hugging Face checkpoint directory."""
    args = parser(prog).parse_args(argv)
    library_log_to(None)  # a read of the run: the one-line errors say what went wrong
    return guarded(lambda: run(args, say=say), trust_code=args.trust_code)


def parser(prog: str = "flaxformer-lite generate") -> argparse.ArgumentParser:
    p = CommandParser(
        prog=prog,
        description="Continue prompts (decoder LMs) or translate them (encoder-decoders) with "
        "a trained run's newest checkpoint or a Hugging Face checkpoint directory; greedy by "
        "default, sampled with --temperature. A decoder LM writes all --max-new-tokens: past its "
        "context (max_length) it goes on from the last three quarters of the context, re-read "
        "every quarter (once said on stderr). Several prompts or samples are separated by a "
        "line of dashes.",
        examples=(
            f'{prog} --run-dir runs/default --prompt "012+034=" --prompt "007-002="',
            f'{prog} --run-dir runs/default --prompt "007-002=" --temperature 0.8 --num-samples 3',
        ),
    )
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--run-dir", type=pathlib.Path, help="a train.py run directory")
    source.add_argument(
        "--hf-dir",
        type=pathlib.Path,
        help="a Hugging Face checkpoint directory (GPT-2, Llama or Marian: "
        "config.json, safetensors and tokenizer.json, or Marian's source.spm + "
        "target.spm + vocab.json)",
    )
    p.add_argument(
        "--adapter",
        type=pathlib.Path,
        help="a PEFT LoRA adapter of --hf-dir (adapter_config.json, adapter_model.safetensors), "
        "merged into its weights",
    )
    p.add_argument(
        "--prompt",
        action="append",
        required=True,
        help="text to continue or translate (repeat for several)",
    )
    p.add_argument(
        "--max-new-tokens",
        type=int,
        default=None,
        help="the most tokens to add, fewer at <eos> (default: 32 for a decoder LM, past its "
        "context too; an encoder-decoder's whole target, its max_length - 1, the most it takes)",
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="0 = greedy (default: 0, reproducible and what transformers' greedy generate "
        "gives for an export; a small text model repeats itself greedily: sample with "
        "--temperature 0.8 --top-k 200, as nanoGPT)",
    )
    p.add_argument(
        "--top-k", type=int, default=None, help="sample from the k most likely (default: all)"
    )
    p.add_argument(
        "--top-p",
        type=float,
        default=None,
        help="sample from the smallest set reaching p (default: 1, all)",
    )
    p.add_argument(
        "--min-tokens-to-keep",
        type=int,
        default=1,
        help="top-k / top-p keep at least this many (default: 1)",
    )
    p.add_argument("--num-samples", type=int, default=1, help="samples per prompt (default: 1)")
    p.add_argument("--seed", type=int, default=0, help="the sampling key (default: 0)")
    p.add_argument(
        "--beam-size",
        type=int,
        default=1,
        help="encoder-decoders: beam search with this many beams (default: 1, none)",
    )
    p.add_argument(
        "--alpha", type=float, default=0.6, help="beam search length penalty (default: 0.6)"
    )
    p.add_argument(
        "--n-best", type=int, default=1, help="beam search: hypotheses to print (default: 1)"
    )
    p.add_argument(
        "--step", type=int, default=None, help="--run-dir's checkpoint step (default: newest)"
    )
    add_trust_code(p)
    return p


def run(args: argparse.Namespace, say=print) -> int:
    """Loads the run or checkpoint and prints one block per prompt (and sample)."""
    check_flags(args)
    import jax  # here, not at the top: --help and a wrong flag need no JAX

    from flaxformer_lite.decode.text import continue_or_translate, printable, translate_beam
    from flaxformer_lite.models import DecoderLM, EncoderDecoder

    if args.hf_dir is None and args.adapter is not None:
        raise ValueError("--adapter applies to --hf-dir, the adapter's base, not --run-dir")
    if args.hf_dir is not None:
        if args.step is not None:
            raise ValueError("--step applies to --run-dir, not --hf-dir")
        from flaxformer_lite.train.trained_run import load_hf_checkpoint

        model, tokenizer = load_hf_checkpoint(args.hf_dir, adapter=args.adapter)
        add_bos, source = tokenizer.add_bos, args.hf_dir
    else:
        from flaxformer_lite.process import use_compilation_cache
        from flaxformer_lite.train.trained_run import load_run

        loaded = load_run(args.run_dir, step=args.step)
        use_compilation_cache(loaded.config.train.compilation_cache)  # before the decoding compiles
        model, tokenizer, add_bos, source = loaded.model, loaded.tokenizer, True, args.run_dir
    if not isinstance(model, DecoderLM | EncoderDecoder):
        raise ValueError(
            f"{source} holds an encoder-only model ({type(model).__name__}); generate needs a "
            "DecoderLM or EncoderDecoder"
        )
    if isinstance(model, DecoderLM) and args.beam_size > 1:
        raise ValueError(
            f"--beam-size {args.beam_size}: beam search is for encoder-decoders, and {source} "
            "holds a decoder LM; continue prompts greedily (the default) or sample "
            "(--temperature, --top-k, --num-samples)"
        )
    prompts = [p for p in args.prompt for _ in range(args.num_samples)]
    if args.max_new_tokens is None:
        decoder_lm = isinstance(model, DecoderLM)
        args.max_new_tokens = 32 if decoder_lm else model.config.max_length - 1
    rng = jax.random.key(args.seed) if args.temperature > 0 else None
    sampling = dict(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_tokens_to_keep=args.min_tokens_to_keep,
        rng=rng,
    )
    if args.beam_size > 1:  # an encoder-decoder: a decoder LM was refused above
        tokens, scores = translate_beam(
            model,
            tokenizer,
            prompts,
            beam_size=args.beam_size,
            alpha=args.alpha,
            max_new_tokens=args.max_new_tokens,
            notify=notice,
        )
        for number, (prompt, beams, beam_scores) in enumerate(
            zip(prompts, tokens, scores, strict=True)
        ):
            say_separator(number, say)
            say(prompt)
            for beam, score in list(zip(beams, beam_scores, strict=True))[: args.n_best]:
                say(f"  {score:9.4f}  {printable(tokenizer.decode(beam))}")
        return 0
    outputs = continue_or_translate(
        model,
        tokenizer,
        prompts,
        max_new_tokens=args.max_new_tokens,
        add_bos=add_bos,
        notify=notice,
        **sampling,
    )
    arrow = " -> " if isinstance(model, EncoderDecoder) else ""
    for number, (prompt, ids) in enumerate(zip(prompts, outputs, strict=True)):
        say_separator(number, say)
        say(f"{prompt}{arrow}{printable(tokenizer.decode(ids))}")
    return 0


def say_separator(number: int, say=print) -> None:
    """A line of dashes before every sample but the first, as nanoGPT's sample.py: samples of
    text run over several lines."""
    if number:
        say(SEPARATOR)


SEPARATOR = "-" * 16


def check_flags(args: argparse.Namespace) -> None:
    """Raises ValueError naming the first flag out of its range or at odds with another."""
    for flag in ("max_new_tokens", "num_samples", "beam_size", "n_best"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            raise ValueError(
                f"--{flag.replace('_', '-')} must be positive, got {getattr(args, flag)}"
            )
    if args.n_best > args.beam_size:
        raise ValueError(f"--n-best ({args.n_best}) cannot exceed --beam-size ({args.beam_size})")
    if not args.temperature >= 0:  # NaN too
        raise ValueError(f"--temperature must be >= 0 (0 is greedy), got {args.temperature}")
    if args.top_k is not None and args.top_k < 1:
        raise ValueError(f"--top-k must be positive, got {args.top_k}")
    if args.top_p is not None and not 0 < args.top_p <= 1:  # NaN too
        raise ValueError(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.min_tokens_to_keep < 1:
        raise ValueError(f"--min-tokens-to-keep must be positive, got {args.min_tokens_to_keep}")
    if args.beam_size > 1 and (args.temperature > 0 or args.num_samples > 1):
        raise ValueError(
            f"--beam-size {args.beam_size} is deterministic: it takes no --temperature "
            "or --num-samples (it prints --n-best hypotheses instead)"
        )
