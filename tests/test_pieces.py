"""A user's own pieces (``models.pieces``): attention functions, mixers, position biases, norms
and feed-forward blocks by registered name or import path; the same losses as the built-in piece
they wrap, a variant that trains and differs, KV-cache decoding, trust, and the one-line errors."""

import json
import os
import pathlib
import re
import shlex
import sys

import jax.numpy as jnp
import numpy as np
import optax
import pytest
import user_pieces
from flax import nnx
from tiny_models import lm_train_step, make, tiny, tokens
from tiny_runs import TINY

import flaxformer_lite
from flaxformer_lite import choices
from flaxformer_lite.attention_maps import attention_maps
from flaxformer_lite.cli import main
from flaxformer_lite.decode import generate
from flaxformer_lite.models import pieces
from flaxformer_lite.registry import trusted_code
from flaxformer_lite.train.config import load_config
from flaxformer_lite.train.loop import run
from flaxformer_lite.train.trained_run import load_run

pytestmark = pytest.mark.fast_compile  # XLA's backend optimizations off: conftest.py

flaxformer_lite.register_attention("same_as_xla", user_pieces.same_as_xla)
flaxformer_lite.register_attention("plus_one", user_pieces.softmax_plus_one)
flaxformer_lite.register_mixer("same_attention", user_pieces.SameAttention)
flaxformer_lite.register_mixer("talking_heads", user_pieces.TalkingHeads)
flaxformer_lite.register_positions("same_relative", user_pieces.same_relative)
flaxformer_lite.register_positions("log_distance", user_pieces.LogDistanceBias)
flaxformer_lite.register_norm("same_layernorm", user_pieces.same_layer_norm)
flaxformer_lite.register_norm("scalenorm", user_pieces.ScaleNorm)
flaxformer_lite.register_norm("picky", user_pieces.PickyNorm)
flaxformer_lite.register_norm("picky_value", user_pieces.picky_value_norm)
flaxformer_lite.register_feed_forward("same_mlp", user_pieces.same_mlp)
flaxformer_lite.register_feed_forward("relu_squared", user_pieces.ReluSquared)

# setting: (the built-in value, the wrapper of it, a variant)
CASES = {
    "attention_implementation": ("xla", "same_as_xla", "plus_one"),
    "mixer": ("attention", "same_attention", "talking_heads"),
    "positions": ("relative", "same_relative", "log_distance"),
    "norm": ("layernorm", "same_layernorm", "scalenorm"),
    "feed_forward": ("mlp", "same_mlp", "relu_squared"),
}


def losses(cfg, steps=3):
    model = make(cfg, train=True)
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    batch = tokens((2, 9))
    return [float(lm_train_step(model, optimizer, batch)) for _ in range(steps)]


@pytest.mark.parametrize("setting", CASES)
def test_a_wrapper_of_the_built_in_gives_its_losses_and_a_variant_differs(setting):
    builtin, wrapper, variant = CASES[setting]
    cfg = tiny("gpt2-tiny", num_decoder_layers=1, **{setting: builtin})
    expected = losses(cfg)
    assert losses(cfg.replace(**{setting: wrapper})) == expected
    changed = losses(cfg.replace(**{setting: variant}))
    assert np.all(np.isfinite(changed)) and changed[-1] < changed[0]  # it trains
    assert abs(changed[0] - expected[0]) > 1e-4  # and computes something else


def greedy_without_cache(model, prompt, new_tokens):
    toks = prompt
    for _ in range(new_tokens):
        toks = jnp.concatenate([toks, jnp.argmax(model(toks)[:, -1:], axis=-1)], axis=1)
    return toks


@pytest.mark.parametrize("setting", ["attention_implementation", "mixer", "positions"])
def test_kv_cache_generation_equals_generation_without_it(setting):
    overrides = {"positions": "learned", setting: CASES[setting][2]}
    model = make(tiny("gpt2-tiny", num_decoder_layers=1, **overrides))
    prompt = tokens((2, 5), seed=3)
    cached = generate(model, prompt, max_new_tokens=4)
    np.testing.assert_array_equal(cached, greedy_without_cache(model, prompt, 4))


def test_registered_pieces_train_on_a_sharded_mesh_without_trust(tmp_path):
    cfg = load_config(
        None,
        [
            f"run_dir={tmp_path}/run",
            "model.attention_implementation=plus_one",
            "model.positions=log_distance",
            "model.feed_forward=relu_squared",
            "mesh.data=2",
            "mesh.fsdp=2",
            "mesh.tensor=2",
            *TINY,
            "train.steps=2",
        ],
    )
    run(cfg, progress=False, log=lambda line: None)
    last = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["step"] == 2 and np.isfinite(last["loss"])
    assert "attention_implementation: plus_one" in (tmp_path / "run" / "config.yaml").read_text()


def test_attention_maps_show_a_variant_weights():
    cfg = tiny("gpt2-tiny", num_decoder_layers=1, mixer="talking_heads")
    model = make(cfg)
    maps = attention_maps(model, tokens((1, 6)))
    layer = model.decoder.layers.layers[0].self_attention
    assert len(maps) == 1 and maps[0].shape == (1, 4, 6, 6)
    # a causal row mixes heads' softmax weights by mix_weights: its rows sum to its column sums
    np.testing.assert_allclose(
        maps[0].sum(-1)[0, :, 0], np.asarray(layer.mix_weights[...]).sum(0), rtol=1e-5
    )


# ---------------------------------------------------------------------- import paths and trust
VARIANT_FILE = """
import pathlib
from flax import nnx
import user_pieces

pathlib.Path("imported.marker").write_text("imported")


def Mixer(cfg, *, num_layers, rngs):
    return user_pieces.TalkingHeads(cfg, num_layers=num_layers, rngs=rngs)


not_callable = 3


def wrong_signature(query, key, value):
    return query


def wrong_shape(call):
    return call.query[..., :1]
"""


@pytest.fixture
def variant_dir(tmp_path, monkeypatch):
    """A directory holding a user's module ``my_variants_<test>`` (it writes imported.marker
    when imported), the current directory."""
    name = "my_variants_" + str(abs(hash(tmp_path)))
    (tmp_path / f"{name}.py").write_text(VARIANT_FILE)
    monkeypatch.chdir(tmp_path)
    yield tmp_path, name
    sys.modules.pop(name, None)


def test_without_trust_the_code_is_not_imported_and_nothing_is_written(variant_dir, capsys):
    directory, name = variant_dir
    argv = ["train", f"model.mixer={name}:Mixer", "run_dir=run", *TINY, "train.steps=2"]
    assert main(argv) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and name in error and "--trust-code" in error
    assert not (directory / "imported.marker").exists() and not (directory / "run").exists()
    assert name not in sys.modules


@pytest.mark.parametrize(
    "attr, message",
    [
        ("absent", "has no attribute absent"),
        ("not_callable", "is a int, not callable"),
        ("wrong_signature", "wrong_signature() missing 2 required positional arguments"),
        ("wrong_shape", "returns float32[2, 8, 4, 1]"),
    ],
)
def test_bad_code_is_one_line_naming_the_setting_before_training(
    variant_dir, capsys, attr, message
):
    directory, name = variant_dir
    key = "model.attention_implementation" if "wrong" in attr else "model.mixer"
    argv = ["train", "--trust-code", f"{key}={name}:{attr}", "run_dir=run", *TINY]
    assert main(argv) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and f"{key}='{name}:{attr}'" in error
    assert message in error, error
    assert not (directory / "run").exists()


@pytest.mark.parametrize("norm", ["picky", "picky_value"])
def test_a_piece_that_fails_at_the_run_s_shapes_is_named_and_leaves_no_run(tmp_path, capsys, norm):
    """It passes the check on 8 positions and fails in the first step on the run's 32: a
    RuntimeError or a ValueError, one line naming the setting, no run directory left."""
    argv = ["train", f"model.norm={norm}", f"run_dir={tmp_path / 'run'}", *TINY]
    assert main(argv) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and "the first train step failed" in error[0], error
    assert f"model.norm='{norm}'" in error[0] and "I only work on 8 positions" in error[0]
    assert not (tmp_path / "run").exists()


def test_a_module_that_does_not_import_is_named(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    argv = ["train", "--trust-code", "model.norm=no_such_module_x:Norm", "run_dir=run", *TINY]
    assert main(argv) == 2
    assert "importing no_such_module_x failed (ModuleNotFoundError" in capsys.readouterr().err


@pytest.fixture(scope="module")
def variant_run(tmp_path_factory):
    """A run trained by ``train --trust-code`` with a mixer named by import path, 4 steps, and
    the same run with the built-in mixer."""
    directory = tmp_path_factory.mktemp("variant")
    name = "talking_cli_variant"
    (directory / f"{name}.py").write_text(VARIANT_FILE)
    cwd = pathlib.Path.cwd()
    try:
        os.chdir(directory)
        common = [*TINY, "train.steps=4", "checkpoint.every=2"]
        assert (
            main(["train", "--trust-code", f"model.mixer={name}:Mixer", "run_dir=run"] + common)
            == 0
        )
        assert main(["train", "run_dir=builtin", *common]) == 0
    finally:
        os.chdir(cwd)
    return directory, name


def test_a_variant_run_records_resumes_generates_and_compares(variant_run, monkeypatch, capsys):
    directory, name = variant_run
    monkeypatch.chdir(directory)
    assert f"mixer: {name}:Mixer" in (directory / "run" / "config.yaml").read_text()
    capsys.readouterr()
    argv = ["train", "--trust-code", f"model.mixer={name}:Mixer", "run_dir=run", *TINY]
    assert main([*argv, "train.steps=6", "checkpoint.every=2"]) == 0
    assert "resumed from step 4" in capsys.readouterr().out
    generate_argv = [
        "generate",
        "--run-dir",
        "run",
        "--prompt",
        "012+034=",
        "--max-new-tokens",
        "3",
    ]
    choices.MIXERS.entries.pop(f"{name}:Mixer")  # as in a new process: the code is not imported
    sys.modules.pop(name)
    assert main(generate_argv) == 2  # the run's settings name code: trust is asked for again
    assert "--trust-code" in capsys.readouterr().err
    assert main([*generate_argv, "--trust-code"]) == 0
    assert main(["compare", "run", "builtin"]) == 0
    assert f"{name}:Mixer" in capsys.readouterr().out
    loaded = load_run("run", trust_code=True)
    assert isinstance(
        loaded.model.decoder.layers.layers[0].self_attention, user_pieces.TalkingHeads
    )
    assert loaded.step == 6


def test_export_refuses_a_variant_naming_the_setting(variant_run, monkeypatch, capsys):
    directory, name = variant_run
    monkeypatch.chdir(directory)
    assert main(["export", "--run-dir", "run", "--out", "exported"]) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and f"model.mixer='{name}:Mixer'" in error
    assert not (directory / "exported").exists()


def test_registering_checks_the_name_and_the_object():
    with pytest.raises(ValueError, match="is built in"):
        flaxformer_lite.register_mixer("attention", user_pieces.TalkingHeads)
    with pytest.raises(ValueError, match="is built in"):
        flaxformer_lite.register_attention("xla", user_pieces.same_as_xla)
    with pytest.raises(ValueError, match="must be callable"):
        flaxformer_lite.register_norm("three", 3)
    with pytest.raises(ValueError, match="mixer must be one of"):
        tiny("gpt2-tiny", mixer="unregistered")
    assert pieces.user_pieces(tiny("gpt2-tiny", norm="scalenorm")) == {"model.norm": "scalenorm"}


def test_the_readme_variant_runs_as_written_in_a_sweep(tmp_path, monkeypatch, capsys):
    """README's my_attention.py trained against the default over its seeds and compared; the
    members are a few steps long here."""
    readme = (pathlib.Path(__file__).parents[1] / "README.md").read_text()
    section = readme[readme.index("## Your own variant") :]
    code = section[section.index("```python\n") + 10 : section.index("```\n")]
    commands = re.findall(r"^\.venv/bin/flaxformer-lite (.*?)(?:  #.*)?$", section, re.M)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_attention.py").write_text(code)
    sweep, compare = (shlex.split(command) for command in commands[:2])
    short = [*TINY, "train.steps=2", "data.train_size=200"]
    assert main([*sweep, *short]) == 0
    capsys.readouterr()
    assert main(compare) == 0
    table = capsys.readouterr().out
    # the group's name: the import path's colon a dot (no file name's on every system)
    assert "my_attention.softmax_plus_one" in table and "n=3" in table.replace(" ", "")


def test_a_resume_with_changed_code_is_refused_unless_forced(tmp_path, monkeypatch, capsys):
    """The run records its pieces' code (pieces.json); the same command after the file was
    edited is refused naming the setting, and --force goes on, saying so."""
    monkeypatch.chdir(tmp_path)
    source = "from user_pieces import same_as_xla as attention\n"
    (tmp_path / "edited_attention.py").write_text(source)
    setting = "model.attention_implementation=edited_attention:attention"
    argv = ["train", "--trust-code", setting, "run_dir=run", *TINY, "checkpoint.every=2"]
    assert main([*argv, "train.steps=2"]) == 0
    recorded = json.loads((tmp_path / "run" / "pieces.json").read_text())
    assert list(recorded) == ["model.attention_implementation"]
    (tmp_path / "edited_attention.py").write_text(source + "# edited\n")
    sys.modules.pop("edited_attention")  # as a new process: the edited file is imported
    choices.ATTENTION.entries.pop("edited_attention:attention")
    before = (tmp_path / "run" / "metrics.jsonl").read_text()
    capsys.readouterr()
    assert main([*argv, "train.steps=4"]) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and f"the code of {setting} changed" in error[0], error
    assert "--force" in error[0] and (tmp_path / "run" / "metrics.jsonl").read_text() == before
    assert main([*argv, "train.steps=4", "--force"]) == 0
    assert f"going on with the changed code of {setting} (--force)" in capsys.readouterr().out
    assert json.loads((tmp_path / "run" / "pieces.json").read_text()) != recorded


def test_a_name_registered_again_with_other_code_is_a_change(tmp_path):
    def first(call):
        return user_pieces.same_as_xla(call)

    def second(call):
        return user_pieces.softmax_plus_one(call)

    settings = [*TINY, f"run_dir={tmp_path / 'run'}", "model.attention_implementation=again"]
    try:
        flaxformer_lite.register_attention("again", first)
        run(load_config(None, [*settings, "train.steps=2"]), progress=False, log=lambda _: None)
        flaxformer_lite.register_attention("again", second)
        with pytest.raises(ValueError, match="the code of model.attention_implementation=again"):
            run(load_config(None, [*settings, "train.steps=4"]), progress=False, log=print)
    finally:
        choices.ATTENTION.entries.pop("again", None)


def test_a_name_registered_in_another_process_is_said_to_need_registering_again():
    with pytest.raises(ValueError) as unknown:
        load_config(None, ["model.norm=my_norm"])
    assert "norm must be one of ('layernorm', 'rmsnorm'" in str(unknown.value)
    assert (
        "a name registered in Python lasts as long as its process: register 'my_norm' again in "
        "this one (flaxformer_lite.register_norm)"
    ) in str(unknown.value)


def test_an_attention_without_weights_says_how_to_give_them(tmp_path, monkeypatch):
    """Attention maps of an import path's function (nothing registered by hand) and of a name
    registered without weights=: each told its own way to give them."""
    from flaxformer_lite import ops

    monkeypatch.chdir(tmp_path)
    (tmp_path / "weightless.py").write_text("from user_pieces import same_as_xla as attend\n")
    q = jnp.ones((1, 4, 2, 8))
    with trusted_code():
        choices.ATTENTION.resolve("weightless:attend")
    try:
        with pytest.raises(ValueError, match="give the function a `weights` attribute"):
            ops.attention_weights(q, q, implementation="weightless:attend")
        flaxformer_lite.register_attention("weightless", user_pieces.same_as_xla)
        with pytest.raises(ValueError, match="register it with weights="):
            ops.attention_weights(q, q, implementation="weightless")
    finally:
        choices.ATTENTION.entries.pop("weightless", None)
        choices.ATTENTION.entries.pop("weightless:attend", None)
        sys.modules.pop("weightless", None)
