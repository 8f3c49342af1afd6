"""The training recipes the package ships: the YAML files of ``flaxformer_lite/configs/``, named
by their path there without ``.yaml`` (``gpt2_small``, ``ablations/aft_full``). ``--config NAME``
reads one from an installed package as from a checkout, whose ``configs/`` links to them.

    recipe_path("gpt2_small")          # .../flaxformer_lite/configs/gpt2_small.yaml
    recipes()["ablations/attention"]   # every recipe, by name
"""

from __future__ import annotations

import difflib
import pathlib
import re

RECIPES = pathlib.Path(__file__).resolve().parents[1] / "configs"


def recipes() -> dict[str, pathlib.Path]:
    """Every shipped recipe, name -> file, sorted by name."""
    paths = sorted(RECIPES.rglob("*.yaml"))
    return {path.relative_to(RECIPES).with_suffix("").as_posix(): path for path in paths}


def summary(path: pathlib.Path) -> str:
    """A recipe's one line: the first sentence of the comment it opens with (to a full stop
    before a capital, so "et al. 2021" and "0.1M" do not end it)."""
    words = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.startswith("#"):
            break
        words += line.lstrip("#").split()
    text = " ".join(words)
    end = re.search(r"\.\s(?=[A-Z\"`])", text)
    return text if end is None else text[: end.start() + 1]


def recipe_path(config: str | pathlib.Path) -> pathlib.Path | None:
    """The shipped recipe that ``config`` names (``gpt2_small`` or ``gpt2_small.yaml``), or None
    where it names none."""
    name = str(config).removesuffix(".yaml")
    return recipes().get(name)


def unknown_recipe_hint(config: str | pathlib.Path) -> str:
    """What to say of a ``--config`` that is neither a file nor a recipe: the closest recipe name
    and where the list is."""
    name = str(config).removesuffix(".yaml")
    close = difflib.get_close_matches(name, recipes(), n=1)
    close = close or difflib.get_close_matches(pathlib.Path(name).name, recipes(), n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return f"{hint}flaxformer-lite config --list names the shipped recipes"
