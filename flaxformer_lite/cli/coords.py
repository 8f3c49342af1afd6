"""``flaxformer-lite coords --out DIR``: muP's coordinate check (:mod:`flaxformer_lite.train.
coord_check`): a config's model trained a few steps at several widths, the mean absolute
activation of each module's output against the width, as DIR/coord_check.png and .json.

    flaxformer-lite coords --config shakespeare_char --out coords/sp optimizer.lr=1e-2
    flaxformer-lite coords --out coords/mup model.parametrization=mup model.mup_base_width=64
"""

from __future__ import annotations

import argparse
import json
import pathlib

from flaxformer_lite.cli.errors import guarded, notice, say
from flaxformer_lite.cli.flags import CONFIG_HELP, CommandParser, add_trust_code

DEFAULT_WIDTHS = (64, 128, 256, 512, 1024)
FIGURE, RECORD = "coord_check.png", "coord_check.json"


def coords_main(argv: list[str] | None = None) -> int:
    """Writes the figure and the record, prints the table of the last step and their paths; a
    bad setting, a width the config refuses or an --out that holds files exits 2."""
    args = coords_parser().parse_intermixed_args(argv)
    return guarded(lambda: _coords(args), trust_code=args.trust_code)


def coords_parser() -> CommandParser:
    """The ``coords`` command's flags and its ``key=value`` overrides."""
    parser = CommandParser(
        prog="flaxformer-lite coords",
        description="muP's coordinate check: build the config's model at each width (d_model; "
        "d_ff 4 x d_model, the heads kept, the layers unscanned, no dropout), train it a few "
        "steps of its optimizer on one fixed batch of random tokens, and draw the mean absolute "
        "value of each module's output (token table, each projection, each layer, the logits; "
        "averaged over layers and seeds) against the width, a panel per step, in "
        "DIR/coord_check.png, with the numbers in DIR/coord_check.json. Under muP the curves "
        "stay flat as the width grows; under the standard parametrization with a large "
        "learning rate the hidden outputs and logits grow with it. Compare the two with "
        "model.parametrization=mup model.mup_base_width=W (W at most the smallest width).",
        examples=(
            "flaxformer-lite coords --config shakespeare_char --out coords/sp optimizer.lr=1e-2",
            "flaxformer-lite coords --config shakespeare_char --out coords/mup "
            "model.parametrization=mup model.mup_base_width=64 optimizer.lr=1e-2",
            "flaxformer-lite coords --widths 32,64,128 --steps 2 --seeds 1 --out coords/quick",
        ),
    )
    parser.add_argument("--config", type=pathlib.Path, help=CONFIG_HELP)
    parser.add_argument(
        "--widths",
        type=_widths,
        default=DEFAULT_WIDTHS,
        metavar="W,W,...",
        help=f"the widths d_model, comma-separated (default: {','.join(map(str, DEFAULT_WIDTHS))})",
    )
    parser.add_argument(
        "--steps", type=_count(0), default=4, help="optimizer steps after init (default: 4)"
    )
    parser.add_argument(
        "--seeds", type=_count(1), default=2, help="initializations averaged (default: 2)"
    )
    parser.add_argument(
        "--batch-size", type=_count(1), default=8, help="rows of the fixed batch (default: 8)"
    )
    parser.add_argument(
        "--out",
        type=pathlib.Path,
        required=True,
        metavar="DIR",
        help="a new (or empty) directory for coord_check.png and coord_check.json",
    )
    add_trust_code(parser)
    parser.add_argument(
        "overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. optimizer.lr=1e-2"
    )
    return parser


def _widths(text: str) -> list[int]:
    try:
        widths = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"widths are comma-separated integers: {text!r}") from None
    if len(widths) < 2 or widths[0] < 1:
        raise argparse.ArgumentTypeError(f"name at least two positive widths, got {text!r}")
    return widths


def _count(least: int):
    def count(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = least - 1
        if value < least:
            raise argparse.ArgumentTypeError(f"an integer >= {least}, got {text!r}")
        return value

    return count


def check_out(out: pathlib.Path) -> None:
    """Raises FileExistsError unless ``out`` is absent or an empty directory."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        what = "a directory that holds files" if out.is_dir() else "a file"
        raise FileExistsError(
            f"--out {out} is {what}; coords writes into a new or empty directory only"
        )


def _coords(args) -> int:
    check_out(args.out)  # before minutes of work
    from flaxformer_lite.train.config import load_config
    from flaxformer_lite.train.coord_check import coord_check, plot_coord_check, scale_table

    cfg = load_config(args.config, args.overrides, notify=notice)
    result = coord_check(
        cfg,
        list(args.widths),
        steps=args.steps,
        seeds=args.seeds,
        batch_size=args.batch_size,
        log=say,
    )
    check_out(args.out)  # nothing else may have written there meanwhile
    args.out.mkdir(parents=True, exist_ok=True)
    record = args.out / RECORD
    record.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    figure = plot_coord_check(result, args.out / FIGURE)
    say("")
    say(scale_table(result))
    say(f"wrote {figure}")
    say(f"wrote {record}")
    return 0
