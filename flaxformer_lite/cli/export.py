"""``flaxformer-lite export --run-dir RUN --out DIR``: a trained run as a Hugging Face directory
(:mod:`flaxformer_lite.train.export`) that ``transformers``' Auto classes and ``AutoTokenizer``
load offline, and ``flaxformer-lite generate --hf-dir DIR`` too.

    flaxformer-lite export --run-dir runs/default --out exports/default
"""

from __future__ import annotations

import pathlib

from flaxformer_lite.cli.errors import guarded, say
from flaxformer_lite.cli.flags import CommandParser, add_trust_code
from flaxformer_lite.cli.library_log import library_log_to


def export_main(argv: list[str] | None = None) -> int:
    """Writes the directory and prints what loads it; a model without a Hugging Face
    counterpart, a missing run or a non-empty ``--out`` exits 2 with one line."""
    args = export_parser().parse_args(argv)
    library_log_to(None)  # a read of the run: the one-line errors say what went wrong
    return guarded(lambda: _export(args), trust_code=args.trust_code)


def export_parser() -> CommandParser:
    """``flaxformer-lite export``'s flags."""
    parser = CommandParser(
        prog="flaxformer-lite export",
        description="Write a run's checkpoint and tokenizer as a Hugging Face directory "
        "(config.json, generation_config.json, model.safetensors, tokenizer.json, "
        "tokenizer_config.json, special_tokens_map.json) that transformers' Auto classes "
        "load offline: GPT-2 and Llama-style decoders, BERT encoders, Marian-style "
        "encoder-decoders. Models with no Hugging Face counterpart (model.mixer=aft_*, "
        "model.local_window) are refused.",
        examples=(
            "flaxformer-lite export --run-dir runs/default --out exports/default",
            "flaxformer-lite export --run-dir runs/gpt2_ft --out exports/gpt2_ft --step 200",
            "flaxformer-lite export --run-dir runs/lora --out exports/lora-adapter --peft",
        ),
    )
    parser.add_argument("--run-dir", type=pathlib.Path, required=True, help="a train.py run")
    parser.add_argument(
        "--out", type=pathlib.Path, required=True, help="the directory to write (new or empty)"
    )
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: newest)")
    parser.add_argument(
        "--peft",
        action="store_true",
        help="write a LoRA run's adapters alone as a PEFT adapter of its init_from model "
        "(adapter_config.json, adapter_model.safetensors); default: the model, merged",
    )
    add_trust_code(parser)
    return parser


def _export(args) -> int:
    from flaxformer_lite.train.export import export_run

    exported = export_run(args.run_dir, args.out, step=args.step, peft=args.peft)
    if args.peft:
        say(
            f"wrote {exported.path}: a PEFT LoRA adapter of step {exported.step} for the "
            f"{exported.architecture} base; load with peft.PeftModel.from_pretrained(base, path)"
        )
        return 0
    say(
        f"wrote {exported.path}: {exported.architecture} of step {exported.step}, "
        f"{exported.tokenizer} tokenizer; load with transformers.{exported.auto_class}"
        f".from_pretrained and AutoTokenizer.from_pretrained"
    )
    for note in exported.notes:
        say(f"note: {note}")
    return 0
