"""load_run: a run trained by train.py comes back as the model its checkpoint holds."""

import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from flaxformer_lite import parallel
from flaxformer_lite.data.tokenizers import ByteTokenizer
from flaxformer_lite.models import DecoderLM, build_model
from flaxformer_lite.train.checkpoint import Checkpointer
from flaxformer_lite.train.checkpoint_format import to_savable
from flaxformer_lite.train.config import load_config
from flaxformer_lite.train.optim import make_optimizer
from flaxformer_lite.train.trained_run import LoadedRun, load_run

pytestmark = pytest.mark.fast_compile  # XLA's backend optimizations off: conftest.py

TOKENS = jnp.asarray([[1, *ByteTokenizer().encode("12+34=46")]])


@pytest.fixture
def run_dir(trained_runs):
    """A tiny one-layer GPT-2-style run on all 8 devices: 2 steps, checkpoints at steps 1 and 2
    (``tiny_runs.SHARED_RUNS["tiny"]``); read, never written (copies are)."""
    return trained_runs("tiny")


def checkpointed_model(run_dir, step):
    """The model of checkpoint ``step``, restored with the Checkpointer directly (single-device
    targets) and written into a fresh model's parameters."""
    cfg = load_config(run_dir / "config.yaml")
    model = build_model(cfg.model, rngs=nnx.Rngs(0))
    tx, _ = make_optimizer(cfg.optimizer, cfg.model, total_steps=cfg.train.steps)
    savable = to_savable(nnx.split((model, nnx.Optimizer(model, tx, wrt=nnx.Param)))[1])
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), savable
    )
    with Checkpointer(run_dir / "checkpoints", keep=3) as checkpointer:
        saved = checkpointer.restore(abstract, step=step).state[0]
    params = nnx.state(model, nnx.Param)

    def subset(saved, like):  # the parameters among the model's saved variables
        if not isinstance(like, dict):
            return saved
        return {key: subset(saved[key], value) for key, value in like.items()}

    nnx.replace_by_pure_dict(params, subset(saved, nnx.to_pure_dict(params)))
    nnx.update(model, params)
    model.eval()
    return model, saved


def test_loads_the_newest_checkpoint(run_dir):
    loaded = load_run(run_dir)
    assert isinstance(loaded, LoadedRun) and isinstance(loaded.model, DecoderLM)
    assert loaded.step == 2
    assert loaded.config == load_config(run_dir / "config.yaml")
    assert loaded.config.model.vocab_size == 260  # resolved from the tokenizer, as trained
    assert isinstance(loaded.tokenizer, ByteTokenizer)
    reference, saved = checkpointed_model(run_dir, 2)
    # Every saved variable of the model (parameters and RNG state) came back unchanged.
    jax.tree.map(np.testing.assert_array_equal, to_savable(nnx.state(loaded.model)), saved)
    np.testing.assert_array_equal(loaded.model(TOKENS), reference(TOKENS))
    # ... and they are trained ones, not the initialization.
    fresh = build_model(loaded.config.model, rngs=nnx.Rngs(params=0, dropout=1))
    fresh.eval()
    assert np.abs(np.asarray(fresh(TOKENS) - loaded.model(TOKENS))).max() > 1e-4


def test_model_is_in_eval_mode_on_one_device(run_dir):
    model = load_run(run_dir).model
    flags = [m.deterministic for _, m in nnx.iter_graph(model) if hasattr(m, "deterministic")]
    assert flags and all(flags)
    np.testing.assert_array_equal(model(TOKENS), model(TOKENS))  # no dropout
    devices = {d for x in jax.tree.leaves(nnx.state(model)) for d in x.devices()}
    assert devices == {jax.local_devices()[0]}


def test_loads_a_given_step(run_dir):
    loaded = load_run(run_dir, step=1)
    assert loaded.step == 1
    reference, _ = checkpointed_model(run_dir, 1)
    np.testing.assert_array_equal(loaded.model(TOKENS), reference(TOKENS))
    newest = load_run(run_dir).model(TOKENS)
    assert np.abs(np.asarray(newest - loaded.model(TOKENS))).max() > 1e-6


def test_loads_onto_a_given_mesh(run_dir):
    mesh = parallel.make_mesh(1, 1, 2, devices=jax.devices()[:2])  # heads split over 2
    loaded = load_run(run_dir, mesh=mesh)
    kernel = loaded.model.decoder.layers.layers[0].self_attention.qkv.kernel[...]
    assert len(kernel.sharding.device_set) == 2
    np.testing.assert_allclose(loaded.model(TOKENS), load_run(run_dir).model(TOKENS), atol=1e-5)


def test_loads_onto_given_devices(run_dir):
    devices = jax.devices()[2:4]
    loaded = load_run(run_dir, devices=devices)
    for x in jax.tree.leaves(nnx.state(loaded.model, nnx.Param)):
        assert x.sharding.device_set == set(devices) and x.sharding.is_fully_replicated
    np.testing.assert_allclose(loaded.model(TOKENS), load_run(run_dir).model(TOKENS), atol=1e-5)
    with pytest.raises(ValueError, match="mesh= or devices=, not both"):
        load_run(run_dir, devices=devices, mesh=parallel.make_mesh(1, 1, 1, devices=devices[:1]))


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"step": "3"}, "step= must be an int (a checkpoint's step), got '3'"),
        ({"step": 3.0}, "step= must be an int (a checkpoint's step), got 3.0"),
        ({"devices": "cpu"}, "devices= must be a list of jax.Device, got 'cpu'"),
        ({"mesh": 5}, "mesh= must be a jax.sharding.Mesh, got 5"),
    ],
)
def test_arguments_of_the_wrong_type_are_named(run_dir, arguments, message):
    """Issue 43 item 17: no step "3", a path .../3.0, AttributeErrors."""
    with pytest.raises(TypeError, match=re.escape(f"load_run: {message}")):
        load_run(run_dir, **arguments)


def test_errors_name_the_path(run_dir, tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match=f"{missing}: no such run directory"):
        load_run(missing)
    with pytest.raises(FileNotFoundError, match=f"{tmp_path / 'checkpoints'}: no checkpoints"):
        load_run(tmp_path)
    (tmp_path / "checkpoints").mkdir()
    with pytest.raises(FileNotFoundError, match="no finished checkpoint"):
        load_run(tmp_path)
    with pytest.raises(ValueError, match=r"no checkpoint for step 7; it has steps \[1, 2\]"):
        load_run(run_dir, step=7)

    no_tokenizer = tmp_path / "no_tokenizer"
    shutil.copytree(run_dir, no_tokenizer, ignore=shutil.ignore_patterns("tokenizer"))
    with pytest.raises(FileNotFoundError, match=str(no_tokenizer / "tokenizer")):
        load_run(no_tokenizer)


def test_unreadable_checkpoint_is_reported_left_in_place_and_the_previous_loaded(
    run_dir, tmp_path, caplog
):
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    for path in (copy / "checkpoints" / "2" / "state").rglob("*"):
        if path.is_file() and path.parent.name == "d":  # the array data files
            path.write_bytes(b"")
    assert load_run(copy).step == 1
    warnings = [r.getMessage() for r in caplog.records if "step 2" in r.getMessage()]
    assert warnings and all(len(w.splitlines()) == 1 for w in warnings), warnings
    assert "TensorStore" not in " ".join(warnings)  # no many-line array spec
    with pytest.raises(ValueError, match=r"step 2 .*cannot be restored.*other steps: \[1\]"):
        load_run(copy, step=2)
    assert (copy / "checkpoints" / "2").is_dir()  # a reader never moves checkpoints aside


def test_generate_skips_a_checkpoint_with_unreadable_metrics(run_dir, tmp_path):
    """Orbax reads every step's metrics item when it opens a directory to train; a reader does
    not need them."""
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    (copy / "checkpoints" / "2" / "metrics" / "metrics").write_text("{not json")
    assert load_run(copy).step == 2


def test_none_readable_names_the_directory(run_dir, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    for path in (copy / "checkpoints").rglob("*"):
        if path.is_file() and path.parent.name == "d":
            path.write_bytes(b"")
    with pytest.raises(ValueError, match="none of the checkpoints in .*steps \\[1, 2\\]") as info:
        load_run(copy)
    assert len(str(info.value).splitlines()) == 1


def test_attention_out_naming_a_file_exits_2_with_one_line(run_dir, tmp_path, capsys):
    from flaxformer_lite.cli import main

    out = tmp_path / "a_file"
    out.write_text("")
    argv = ["attention", "--run_dir", str(run_dir), "--text", "1+2=", "--out", str(out)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(out) in err[0], err
