"""Issue 64: the settings' vocabulary (``flaxformer_lite.choices``) and the one registry idiom
(``flaxformer_lite.registry``), read without JAX; ``plot``, ``compare`` and ``config`` start
without it."""

import json
import pkgutil
import subprocess
import sys

import pytest
import yaml

import flaxformer_lite
from flaxformer_lite import choices, models, nn, ops, parallel
from flaxformer_lite.nn.mlp import _NONLINEARITIES
from flaxformer_lite.nn.stack import REMAT_POLICIES
from flaxformer_lite.ops import attention, attention_choice, losses
from flaxformer_lite.registry import Registry, trusted_code
from flaxformer_lite.train.config import TrainConfig
from flaxformer_lite.train.run_dir import MARK


def test_each_name_is_implemented_where_the_table_says():
    """The names the config checks are the ones the code implements."""
    assert {nonlinearity for nonlinearity, _ in choices.ACTIVATIONS.values()} == set(
        _NONLINEARITIES
    )
    assert tuple(REMAT_POLICIES) == choices.REMAT_NAMES
    for registry in (choices.ATTENTION, choices.MIXERS, choices.POSITION_BIASES, choices.NORMS):
        for name in registry.builtin:
            assert callable(registry.resolve(name)), (registry.setting, name)
    assert choices.ATTENTION.resolve("xla") is attention_choice.XLA
    assert attention_choice.IMPLEMENTATIONS == ("cudnn", "pallas", "chunked", "xla")


def test_every_name_a_package_exports_resolves_when_first_read():
    """The packages import their names' modules on first use (``flaxformer_lite.lazy``)."""
    for package in (flaxformer_lite, ops, nn, models, parallel):
        for name in package.__all__:
            assert getattr(package, name) is not None, (package.__name__, name)
        assert set(package.__all__) - {"__version__"} <= set(dir(package))
        # A name that is also a submodule's would become the module once that is imported.
        submodules = {info.name for info in pkgutil.iter_modules(package.__path__)}
        assert not set(package.__all__) & submodules, package.__name__
    assert ops.dot_product_attention is attention.dot_product_attention
    assert ops.cross_entropy is losses.cross_entropy
    assert ops.masks.causal_mask is ops.causal_mask  # a submodule by its name
    with pytest.raises(AttributeError, match="nonesuch"):
        _ = ops.nonesuch


def test_every_choice_registers_one_way():
    """Issue 64: attention implementations, the model's pieces, sources, tasks and tokenizers
    are each a Registry: a mapping of name -> object, its built-ins first."""
    from flaxformer_lite.data.sources import SOURCES
    from flaxformer_lite.data.tasks import TASKS
    from flaxformer_lite.data.tokenizers import FITTED_TOKENIZERS, TOKENIZERS

    registries = (choices.ATTENTION, choices.MIXERS, choices.NORMS, SOURCES, TASKS, TOKENIZERS)
    assert all(isinstance(registry, Registry) for registry in registries)
    assert tuple(SOURCES) == ("synthetic", "text", "jsonl", "parallel", "prepared")
    assert tuple(TOKENIZERS) == ("byte", "char", "word", "bpe", "sentencepiece")
    assert FITTED_TOKENIZERS == ("char", "word", "bpe")
    assert all(task.name == name for name, task in TASKS.items())
    with pytest.raises(ValueError, match="data.source must be one of synthetic, text"):
        SOURCES.check("csv")


def test_a_registry_resolves_built_ins_on_first_use_and_imports_paths_only_when_trusted():
    registry = Registry("model.thing", "fn() -> int", {"json": "json:dumps"})
    assert registry.entries["json"] == "json:dumps"  # nothing imported by checking a name
    registry.check("json")
    assert registry["json"] is registry.resolve("json") is json.dumps
    assert list(registry) == ["json"] and registry.get("nonesuch") is None
    with pytest.raises(ValueError, match="built in"):
        registry.register("json", len)
    registry.register("length", len)
    assert registry.resolve("length") is len and not registry.is_builtin("length")
    with pytest.raises(ValueError, match="names code to import"):
        registry.resolve("os.path:join")
    with trusted_code():
        import os.path

        assert registry.resolve("os.path:join") is os.path.join
    with pytest.raises(ValueError, match="must be one of"):
        registry.check("nonesuch")


@pytest.mark.parametrize("command", ["plot", "compare", "config"])
def test_commands_that_read_files_import_no_jax(tmp_path, command):
    """Reading and checking a config imports no JAX: ``plot`` and ``compare`` of runs as
    ``train.py`` leaves them, ``config``, and the config schema itself."""
    for name in ("a", "b"):
        run = tmp_path / name
        run.mkdir()
        (run / "run.json").write_text(json.dumps(MARK))
        (run / "config.yaml").write_text(yaml.safe_dump(TrainConfig().to_dict(), sort_keys=False))
        records = [{"step": s, "loss": 2.0 / s} for s in (1, 2, 3)]
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    argv = {
        "plot": ["plot", str(tmp_path / "a")],
        "compare": ["compare", *map(str, [tmp_path / "a", tmp_path / "b"])],
        "config": ["config"],
    }[command]
    code = (
        "import sys\n"
        "from flaxformer_lite.cli import main\n"
        f"status = main({argv!r})\n"
        "import flaxformer_lite.train.config\n"
        "print(status, *[m for m in ('jax', 'flax', 'optax', 'orbax') if m in sys.modules])"
    )
    child = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert child.returncode == 0, child.stderr
    assert child.stdout.splitlines()[-1] == "0", child.stdout[-500:]


def test_the_model_kind_is_a_value_with_behaviour():
    """Issue 64: ``model.kind`` is resolved once into a value that says what follows from it
    (no string comparisons), written as its plain name."""
    from flaxformer_lite.models.config import ModelConfig, ModelKind

    decoder = ModelConfig(num_encoder_layers=0, num_decoder_layers=1, vocab_size=16)
    encoder = ModelConfig(num_encoder_layers=1, num_decoder_layers=0, vocab_size=16)
    both = ModelConfig(num_encoder_layers=1, num_decoder_layers=1, vocab_size=16)
    kinds = (decoder.kind, encoder.kind, both.kind)
    assert kinds == (ModelKind.DECODER, ModelKind.ENCODER, ModelKind.ENCODER_DECODER)
    assert [kind.generates for kind in kinds] == [True, False, True]
    assert [kind.is_seq2seq for kind in kinds] == [False, False, True]
    assert (
        f"{both.kind}" == "encoder_decoder"
        and yaml.safe_dump(str(encoder.kind)) == "encoder\n...\n"
    )
    assert encoder.kind.words == "an encoder-only model"
    assert repr(encoder.kind) == "'encoder'"  # as settings show it in messages
