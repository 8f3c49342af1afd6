"""The state tree of every preset and variant (paths, shapes, dtypes, logical axis names,
variable types) is fixed: checkpoints and the Hugging Face rules of ``interop`` name
parameters by these paths.

``tests/data/state_paths.json`` holds each config's listing, loop and scanned stacks. Layers of
a loop stack are listed once, as ``{i}``, with their count. After a deliberate change of the
tree, rewrite the file with ``python tests/test_state_paths.py``.
"""

import json
import pathlib
import re
import sys

import jax
import pytest
from flax import nnx

from flaxformer_lite.models import PRESETS, ModelConfig, build_model

GOLDEN = pathlib.Path(__file__).parent / "data" / "state_paths.json"
_LAYER_INDEX = re.compile(r"(?<=\.layers\.layers\.)\d+(?=\.)")


def state_listing(cfg: ModelConfig) -> list[str]:
    """One line per variable of the model ``cfg`` builds: ``path type shape dtype names``, a
    loop stack's layers folded into one ``{i}`` line with a count."""
    model = nnx.eval_shape(lambda: build_model(cfg, rngs=nnx.Rngs(0)))
    counts: dict[str, int] = {}
    for path, variable in nnx.to_flat_state(nnx.state(model)):
        value = variable.get_value()
        dtype = value.dtype
        if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
            dtype = "key"
        names = variable.get_metadata().get("out_sharding")
        dotted = ".".join(str(part) for part in path)
        line = (
            f"{_LAYER_INDEX.sub('{i}', dotted)} {type(variable).__name__} "
            f"{list(value.shape)} {dtype} {list(names) if names else '-'}"
        )
        counts[line] = counts.get(line, 0) + 1
    return sorted(f"{line} x{n}" if n > 1 else line for line, n in counts.items())


# The presets, and the parts no preset has: relative positions, a classifier, continuous
# inputs and outputs, a parallel block, untied tables.
CONFIGS = {
    **{name: (name, {}) for name in PRESETS},
    "transformer-tiny relative": ("transformer-tiny", dict(positions="relative")),
    "transformer-tiny untied": (
        "transformer-tiny",
        dict(share_src_tgt_embeddings=False, tie_embeddings=False),
    ),
    "bert-tiny classifier": ("bert-tiny", dict(num_classes=3)),
    "gpt2-tiny continuous": ("gpt2-tiny", dict(input_dim=5, output_dim=3, tie_embeddings=False)),
    "llama-tiny parallel": ("llama-tiny", dict(parallel_block=True)),
}


def config(name: str, scan: bool) -> ModelConfig:
    preset, overrides = CONFIGS[name]
    return ModelConfig.from_preset(preset, scan_layers=scan, **overrides)


def listings() -> dict[str, list[str]]:
    return {
        f"{name} scan={scan}": state_listing(config(name, scan))
        for name in sorted(CONFIGS)
        for scan in (False, True)
    }


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("scan", [False, True])
def test_the_state_tree_is_unchanged(name, scan):
    expected = json.loads(GOLDEN.read_text())[f"{name} scan={scan}"]
    assert state_listing(config(name, scan)) == expected


if __name__ == "__main__":
    GOLDEN.write_text(json.dumps(listings(), indent=1) + "\n")
    sys.exit(0)
