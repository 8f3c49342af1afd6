"""Greedy generation side by side: tokens/s with the KV cache, without it, and Hugging Face's.

    python benchmarks/generate.py                       # 256 new tokens, batch 1 and 8: README
    python benchmarks/generate.py --new-tokens 64 --batch-sizes 1 --repeats 3 --no-hf

The model is GPT-2-shaped (the ``gpt2-small`` preset: pre-LN, learned positions, gelu_tanh,
fused QKV, tied embeddings) scaled down so that the run takes minutes on a small CPU: by default
4 layers, d_model 256, 4 heads, d_ff 1024, an 8192-token vocabulary and a position table of 1024
(5.5M parameters, float32, dropout off). Its random weights are multiplied by
``--weight-scale`` (3, as in tests/decode_cases.py) so that greedy tokens vary from step to step
instead of repeating one token, which gives the agreement check below some teeth; the speed
does not depend on the values. Every row of a batch holds a prompt of ``--prompt-length``
random tokens (32 by default); each method continues it greedily by exactly ``--new-tokens``
tokens (no end-of-sequence token), so tokens/s is ``batch * new_tokens / seconds`` and includes
reading the prompt. The three ways:

* ``cache``: :func:`flaxformer_lite.decode.generate`, greedy, the public call as a user makes it
  (prefill and the whole KV-cache loop are one compiled program);
* ``no cache``: the same model recomputing the whole prefix every step: one compiled program
  whose ``lax.fori_loop`` runs the causal model over a fixed buffer of ``prompt + new_tokens``
  slots (the slots after the current position hold zeros, which a causal model never reads) and
  projects only the hidden state at the current position onto the vocabulary. Every step
  therefore costs a full-length forward pass; a buffer growing with the text would do about half
  the work on average (at the price of a program per length);
* ``hf``: Hugging Face transformers' ``GPT2LMHeadModel`` (PyTorch, CPU, eager) of the same
  shape with its own random weights, ``model.generate(..., do_sample=False, use_cache=True)``
  on every core (``hf_gpt2.py``). It is skipped, with a line saying so, when torch or
  transformers cannot be imported, or with ``--no-hf``.

Before timing, the cached program is compiled by a warm-up call (its compile time read from
JAX's compilation events), the uncached one ahead of time (``.lower().compile()``, by the clock)
and Hugging Face warmed up by a short call. Then ``--repeats`` rounds call every method and
batch size once each, interleaved so that the noise of a shared machine hits them alike, and
the median of the rounds is reported. The cached and uncached paths must produce the same
tokens (checked on the first round's outputs; a FAIL line names the first difference and the
top-2 logit margin there). The output is a markdown table, PASS/FAIL lines for the targets
(cache >= 10x no cache at 256 new tokens, cache >= 2x Hugging Face) and, as the last line, one
JSON object with every number.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from flaxformer_lite.decode import generate
from flaxformer_lite.models import ModelConfig, build_model

import hf_gpt2

NO_CACHE_TARGET = 10.0  # cache tokens/s over no-cache tokens/s, at 256 new tokens
HF_TARGET = 2.0  # our (cached) tokens/s over Hugging Face's


# ----------------------------------------------------------------------------- the model
def model_config(args) -> ModelConfig:
    return ModelConfig.from_preset(
        "gpt2-small",
        num_decoder_layers=args.layers,
        d_model=args.d_model,
        num_heads=args.heads,
        d_ff=args.d_ff or 4 * args.d_model,
        vocab_size=args.vocab,
        max_length=args.max_length,
        embedding_dropout=0.0,
        attention_dropout=0.0,
        residual_dropout=0.0,
    )


_COMPILE_EVENTS = (
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "/jax/core/compile/backend_compile_duration",
)
_compile_seconds = [0.0]


def _on_event(event: str, duration: float, **_) -> None:
    if event in _COMPILE_EVENTS:
        _compile_seconds[0] += duration


jax.monitoring.register_event_duration_secs_listener(_on_event)


def timed(call):
    """``(result, wall seconds, compile seconds)`` of ``call()``, finished on the device."""
    compiled_before = _compile_seconds[0]
    start = time.perf_counter()
    result = jax.block_until_ready(call())
    return result, time.perf_counter() - start, _compile_seconds[0] - compiled_before


# ----------------------------------------------------------------------------- no cache
@functools.partial(jax.jit, static_argnames=("graphdef", "prompt_length"))
def _greedy_no_cache(graphdef, state, buffer, *, prompt_length):
    """Greedy tokens for ``buffer[:, prompt_length:]`` by a full causal forward pass per step.

    ``buffer`` int32 ``[B, T]`` holds the prompts in its first ``prompt_length`` slots. Step ``p``
    runs the model's embedding and layers over all ``T`` slots (slots ``>= p`` do not reach
    position ``p - 1`` through the causal mask), projects the hidden state at ``p - 1`` onto the
    vocabulary and writes the argmax at ``p``. This is :class:`DecoderLM`'s forward pass with
    the output head applied at one position instead of ``T``.
    """
    positions = jnp.arange(buffer.shape[1])

    def step(position, buffer):
        model = nnx.merge(graphdef, state)
        hidden = model.decoder(model.embed(buffer, positions), positions=positions)
        last = jax.lax.dynamic_index_in_dim(hidden, position - 1, axis=1, keepdims=False)
        token = jnp.argmax(model.head(last), axis=-1).astype(jnp.int32)
        return jax.lax.dynamic_update_index_in_dim(buffer, token, position, axis=1)

    return jax.lax.fori_loop(prompt_length, buffer.shape[1], step, buffer)


def compile_no_cache(model, batch: int, prompt_length: int, new_tokens: int):
    """``(run, compile seconds)``: ``run(prompt)`` maps int32 prompts ``[B, prompt_length]`` to
    ``[B, prompt_length + new_tokens]``, the prompts and their greedy tokens without a cache,
    compiled ahead of time (no warm-up run needed)."""
    graphdef, state = nnx.split(model)
    buffer = jax.ShapeDtypeStruct((batch, prompt_length + new_tokens), jnp.int32)
    start = time.perf_counter()
    compiled = _greedy_no_cache.lower(graphdef, state, buffer, prompt_length=prompt_length)
    compiled = compiled.compile()
    seconds = time.perf_counter() - start

    def run(prompt):
        padded = np.zeros((batch, prompt_length + new_tokens), np.int32)
        padded[:, :prompt_length] = prompt
        return compiled(state, padded)

    return run, seconds


def first_difference(model, cached, uncached, prompt_length: int) -> dict:
    """Where the two greedy outputs first differ, and the top-2 logit margin there (float
    round-off can only flip a near tie)."""
    rows, cols = np.nonzero(np.asarray(cached) != np.asarray(uncached))
    order = np.lexsort((rows, cols))
    row, col = int(rows[order[0]]), int(cols[order[0]])
    graphdef, state = nnx.split(model)
    logits = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))(state, cached[row : row + 1, :col])
    top2 = np.sort(np.asarray(logits[0, -1], np.float64))[-2:]
    return {
        "row": row,
        "new_token": col - prompt_length,
        "cache": int(cached[row, col]),
        "no_cache": int(uncached[row, col]),
        "top2_margin": float(top2[1] - top2[0]),
    }


# ----------------------------------------------------------------------------- the benchmark
def run(args) -> dict:
    cfg = model_config(args)
    if args.prompt_length + args.new_tokens > cfg.max_length:
        raise SystemExit(
            f"--prompt-length + --new-tokens = {args.prompt_length + args.new_tokens}"
            f" exceeds --max-length {cfg.max_length}"
        )
    model = build_model(cfg, rngs=nnx.Rngs(args.seed))
    model.eval()
    if args.weight_scale != 1:  # as tests/decode_cases.py does: tokens vary from step to step
        params = nnx.state(model, nnx.Param)
        nnx.update(model, jax.tree.map(lambda x: x * args.weight_scale, params))
    libraries, hf_skipped = (None, "--no-hf") if args.no_hf else hf_gpt2.load_torch()
    hf = (
        None
        if libraries is None
        else hf_gpt2.gpt2_model(libraries, cfg, args.seed, pad_token_id=0).eval()
    )
    rng = np.random.default_rng(args.seed)
    prompts = {
        b: rng.integers(1, cfg.vocab_size, (b, args.prompt_length)).astype(np.int32)
        for b in args.batch_sizes
    }

    rows = {b: {"batch": b} for b in args.batch_sizes}
    calls = {}  # (batch, method) -> a call generating for that batch's prompts
    for b, row in rows.items():  # compile (cache: a warm-up call), and warm Hugging Face up
        prompt = prompts[b]
        calls[b, "cache"] = functools.partial(
            generate, model, prompt, max_new_tokens=args.new_tokens
        )
        row["cache_compile_s"] = timed(calls[b, "cache"])[2]
        run_no_cache, row["no_cache_compile_s"] = compile_no_cache(
            model, b, args.prompt_length, args.new_tokens
        )
        calls[b, "no_cache"] = functools.partial(run_no_cache, prompt)
        if hf is not None:
            hf_gpt2.generate(libraries, hf, prompt, min(args.new_tokens, 8))
            calls[b, "hf"] = functools.partial(
                hf_gpt2.generate, libraries, hf, prompt, args.new_tokens
            )
        print(
            f"[batch {b}] compiled: cache {row['cache_compile_s']:.1f} s, no cache "
            f"{row['no_cache_compile_s']:.1f} s",
            file=sys.stderr,
            flush=True,
        )

    methods = ["cache", "no_cache"] + ([] if hf is None else ["hf"])
    times = {key: [] for key in calls}
    for round_ in range(args.repeats):
        for b in args.batch_sizes:
            outputs = {}
            for name in methods:
                outputs[name], seconds, _ = timed(calls[b, name])
                times[b, name].append(seconds)
            if round_ == 0:  # the two greedy paths must agree token for token
                cached, uncached = np.asarray(outputs["cache"]), np.asarray(outputs["no_cache"])
                rows[b]["tokens_identical"] = bool(np.array_equal(cached, uncached))
                rows[b]["distinct_new_tokens"] = len(np.unique(cached[:, args.prompt_length :]))
                if not rows[b]["tokens_identical"]:
                    rows[b]["first_difference"] = first_difference(
                        model, cached, uncached, args.prompt_length
                    )
        print(f"round {round_ + 1}/{args.repeats} done", file=sys.stderr, flush=True)

    for b, row in rows.items():
        for name in methods:
            seconds = statistics.median(times[b, name])
            row[f"{name}_s"] = seconds
            row[f"{name}_times_s"] = times[b, name]
            row[f"{name}_tokens_per_s"] = b * args.new_tokens / seconds
        row["cache_over_no_cache"] = row["cache_tokens_per_s"] / row["no_cache_tokens_per_s"]
        if hf is not None:
            row["cache_over_hf"] = row["cache_tokens_per_s"] / row["hf_tokens_per_s"]

    versions = {"jax": jax.__version__, "python": platform.python_version()}
    if libraries is not None:
        versions |= {
            "torch": libraries[0].__version__,
            "transformers": libraries[1].__version__,
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        }
    return {
        **versions,
        "cpu_count": os.cpu_count(),
        "backend": jax.default_backend(),
        "model": {
            k: getattr(cfg, k)
            for k in (
                "num_decoder_layers",
                "d_model",
                "num_heads",
                "d_ff",
                "vocab_size",
                "max_length",
            )
        },
        "parameters": sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param))),
        "prompt_length": args.prompt_length,
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "weight_scale": args.weight_scale,
        "hf_skipped": hf_skipped,
        "rows": list(rows.values()),
    }


def table(summary: dict) -> list[str]:
    hf = summary["hf_skipped"] is None
    head = ["batch", "cache tok/s", "no cache tok/s"] + (["HF tok/s"] if hf else [])
    head += ["cache / no cache"] + (["cache / HF"] if hf else [])
    head += ["cache compile s", "no cache compile s", "same tokens"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in summary["rows"]:
        cells = [
            str(row["batch"]),
            f"{row['cache_tokens_per_s']:.0f}",
            f"{row['no_cache_tokens_per_s']:.0f}",
        ]
        cells += [f"{row['hf_tokens_per_s']:.0f}"] if hf else []
        cells += [f"{row['cache_over_no_cache']:.1f}x"]
        cells += [f"{row['cache_over_hf']:.2f}x"] if hf else []
        cells += [
            f"{row['cache_compile_s']:.1f}",
            f"{row['no_cache_compile_s']:.1f}",
            "yes" if row["tokens_identical"] else "NO",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def spread_of(times: list[float]) -> float:
    return max(times) / min(times)


def checks(summary: dict) -> list[str]:
    lines = []

    def check(description, ok):
        lines.append(f"{'PASS' if ok else 'FAIL'}: {description}")

    for row in summary["rows"]:
        b = row["batch"]
        if row["tokens_identical"]:
            check(f"batch {b}: cached and uncached greedy tokens are identical", True)
        else:
            check(
                f"batch {b}: cached and uncached greedy tokens differ: {row['first_difference']}",
                False,
            )
        if summary["new_tokens"] == 256:
            ratio = row["cache_over_no_cache"]
            check(
                f"batch {b}: cache / no cache = {ratio:.1f}x >= {NO_CACHE_TARGET:g}x",
                ratio >= NO_CACHE_TARGET,
            )
        if "cache_over_hf" in row:
            ratio = row["cache_over_hf"]
            check(
                f"batch {b}: cache / Hugging Face = {ratio:.2f}x >= {HF_TARGET:g}x",
                ratio >= HF_TARGET,
            )
    return lines


def parser() -> argparse.ArgumentParser:
    """The command line of this benchmark (tests/test_readme.py parses the documented commands)."""
    command_line = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    command_line.add_argument("--new-tokens", type=int, default=256)
    command_line.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    command_line.add_argument(
        "--repeats", type=int, default=5, help="timed rounds (median reported)"
    )
    command_line.add_argument("--prompt-length", type=int, default=32)
    command_line.add_argument("--no-hf", action="store_true", help="skip Hugging Face transformers")
    command_line.add_argument("--layers", type=int, default=4)
    command_line.add_argument("--d-model", type=int, default=256)
    command_line.add_argument("--heads", type=int, default=4)
    command_line.add_argument("--d-ff", type=int, default=0, help="0: 4 * d_model")
    command_line.add_argument("--vocab", type=int, default=8192)
    command_line.add_argument("--max-length", type=int, default=1024, help="position table size")
    command_line.add_argument("--seed", type=int, default=0)
    command_line.add_argument(
        "--weight-scale",
        type=float,
        default=3.0,
        help="multiply our random weights (varied greedy tokens)",
    )
    return command_line


def main(argv=None) -> dict:
    command_line = parser()
    args = command_line.parse_args(argv)
    if args.new_tokens < 1 or args.prompt_length < 1 or args.repeats < 1:
        command_line.error("--new-tokens, --prompt-length and --repeats must be positive")

    summary = run(args)
    model = summary["model"]
    print(hf_gpt2.versions_line(summary))
    print(
        f"GPT-2-style: {model['num_decoder_layers']} layers, d_model {model['d_model']}, "
        f"{model['num_heads']} heads, d_ff {model['d_ff']}, vocab {model['vocab_size']} "
        f"({summary['parameters']:,} parameters), float32; prompt "
        f"{summary['prompt_length']} + {summary['new_tokens']} new tokens, greedy; median of "
        f"{summary['repeats']} rounds"
    )
    if summary["hf_skipped"] is not None:
        print(f"Hugging Face skipped: {summary['hf_skipped']}")
    print()
    print("\n".join(table(summary)))
    print()
    methods = ["cache", "no_cache"] + (["hf"] if summary["hf_skipped"] is None else [])
    for row in summary["rows"]:
        spread = ", ".join(
            f"{name.replace('_', ' ')} {spread_of(row[f'{name}_times_s']):.2f}" for name in methods
        )
        print(f"batch {row['batch']}: slowest / fastest round: {spread}")
    print()
    print("\n".join(checks(summary)))
    print(json.dumps(summary), flush=True)
    return summary


if __name__ == "__main__":
    main()
