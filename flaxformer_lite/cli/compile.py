"""``flaxformer-lite compile``: compile a config's train step (or generation) ahead of time for a
TPU slice or H100s, from any host, and report what it needs per chip.

    flaxformer-lite compile --config gpt2_small --topology v5e-8 mesh.fsdp=8
    flaxformer-lite compile --topology v5p-8 --decode
    flaxformer-lite compile --topology cpu-8 mesh.data=2 mesh.tensor=4

The report gives per chip the bytes of parameters, optimizer state and XLA's temporaries and
their total against the chip's HBM, the FLOPs of a step, its collectives and the bytes they
move, the attention implementation the trace chose, and a roofline estimate of the step time
and MFU (:mod:`flaxformer_lite.aot.report`); its last line is one JSON object. Exit status 0
when the program fits the chips' memory, 1 when it does not (a line says by how much), 2 for
an unknown topology, a mesh that does not match it, a bad config, or no libtpu (``pip install
-e ".[tpu]"``) or, for ``h100-N``, no CUDA plugin (``".[gpu-compile]"``). ``cpu-N`` compiles
for N simulated CPU devices of this process (its device count is set before JAX starts its
backend).
"""

from __future__ import annotations

import argparse
import json
import pathlib

from flaxformer_lite.cli.errors import guarded, notice, say
from flaxformer_lite.cli.flags import CONFIG_HELP, CommandParser, add_trust_code


def compile_main(argv: list[str] | None = None) -> int:
    """``flaxformer-lite compile``: see the module docstring."""
    args = compile_parser().parse_intermixed_args(argv)
    return guarded(lambda: _compile(args), trust_code=args.trust_code)


def compile_parser() -> argparse.ArgumentParser:
    """``flaxformer-lite compile``'s flags and its ``key=value`` overrides."""
    parser = CommandParser(
        prog="flaxformer-lite compile",
        description="Compile a config's train step (or, with --decode, its generation loop) "
        "ahead of time for a TPU slice or H100s, on any host, and report its memory per chip "
        "against the chip's HBM, its collectives and a roofline estimate of the step time and "
        "MFU. Exit 0: it fits; 1: it does not; 2: an unknown topology or a mesh that does not "
        "match it.",
        examples=(
            "flaxformer-lite compile --config gpt2_small --topology v5e-8",
            "flaxformer-lite compile --topology v5p-8 mesh.data=1 mesh.fsdp=-1",
            "flaxformer-lite compile --topology cpu-4 --decode",
        ),
    )
    parser.add_argument("--config", type=pathlib.Path, help=CONFIG_HELP)
    parser.add_argument(
        "--topology",
        required=True,
        help="v4-N, v5p-N (N cores), v5e-N, v6e-N (N chips), libtpu's v5e:2x4, h100-N or cpu-N",
    )
    parser.add_argument(
        "--decode", action="store_true", help="compile the generation loop, not the train step"
    )
    parser.add_argument(
        "--max-new-tokens", type=int, default=32, help="--decode: tokens generated per prompt"
    )
    parser.add_argument(
        "overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. mesh.fsdp=8"
    )
    add_trust_code(parser)
    return parser


def _compile(args) -> int:
    from flaxformer_lite.aot import analyse, compile_for, parse_topology, prepare_host
    from flaxformer_lite.process import use_compilation_cache
    from flaxformer_lite.train.config import load_config

    topology = parse_topology(args.topology)
    prepare_host(topology)  # before anything starts a JAX backend
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    cfg = load_config(args.config, args.overrides, notify=notice)
    use_compilation_cache(cfg.train.compilation_cache)
    program = compile_for(cfg, topology, decode=args.decode, max_new_tokens=args.max_new_tokens)
    report = analyse(program, topology)
    for line in report.lines():
        say(line)
    if report.fits is False:
        total, hbm = report.total / 2**30, report.hbm / 2**30
        say(
            f"does not fit: {total:.2f} GiB per chip is {total - hbm:.2f} GiB more than the "
            f"{hbm:.2f} GiB of HBM ({total / hbm:.1f}x); shard more (mesh.fsdp, mesh.tensor), "
            "use more chips, or a smaller train.batch_size with train.grad_accum_steps or "
            "model.remat"
        )
    say(json.dumps(report.summary()))
    return 1 if report.fits is False else 0
