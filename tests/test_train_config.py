"""The training configuration: YAML, dotted overrides, types, unknown keys, diffs."""

import dataclasses
import pathlib

import pytest
import yaml

from flaxformer_lite.models import ModelConfig
from flaxformer_lite.ops import RopeScaling
from flaxformer_lite.train.config import (
    ConfigError,
    TrainConfig,
    config_diff,
    config_from_dict,
    is_runtime_key,
    load_config,
    valid_keys,
)
from flaxformer_lite.train.config_keys import OTHER_NAMES
from flaxformer_lite.train.recipes import recipe_path, recipes, summary


def test_defaults_and_typed_overrides():
    cfg = load_config(
        None,
        [
            "train.steps=200",
            "model.num_heads=2",
            "optimizer.lr=1e-3",
            "run_dir=runs/x",
            "optimizer.clip_norm=none",
            "model.scan_layers=true",
            "mesh.data=2",
            "seed=7",
        ],
    )
    default = TrainConfig()
    assert cfg == dataclasses.replace(
        default,
        run_dir="runs/x",
        seed=7,
        model=default.model.replace(num_heads=2, scan_layers=True),
        optimizer=dataclasses.replace(default.optimizer, lr=1e-3, clip_norm=None),
        train=dataclasses.replace(default.train, steps=200),
        mesh=dataclasses.replace(default.mesh, data=2),
    )
    assert isinstance(cfg.optimizer.lr, float) and isinstance(cfg.run_dir, str)


def test_the_embedded_default_is_configs_default_yaml():
    repo = pathlib.Path(__file__).resolve().parents[1]
    assert load_config(repo / "configs" / "default.yaml") == TrainConfig()


@pytest.mark.parametrize(
    "name",
    [
        "default",
        "transformer_tiny",
        "transformer_base",
        "gpt2_small",
        "bert_base",
        "bert_tiny",
        "llama_style",
    ],
)
def test_every_preset_file_loads(name):
    repo = pathlib.Path(__file__).resolve().parents[1]
    cfg = load_config(repo / "configs" / f"{name}.yaml")
    assert cfg.run_dir == f"runs/{name}"


@pytest.mark.parametrize("name", ["transformer_base", "gpt2_small", "bert_base", "llama_style"])
def test_the_accelerator_recipes_compute_in_bf16_on_float32_parameters(name):
    """Each sets its remat policy; the decoders train on real text without attention dropout
    (the Pallas kernel takes none) and compute their loss in blocks."""
    cfg = load_config(name)
    model = cfg.model
    assert (model.dtype, model.param_dtype) == ("bfloat16", "float32")
    assert "remat" in yaml.safe_load(recipe_path(name).read_text())["model"]
    if model.kind == "decoder":
        assert model.attention_dropout == 0.0 and cfg.train.loss_chunk is not None
        assert (cfg.data.source, cfg.data.path) == ("text", "builtin:tinyshakespeare")
        assert cfg.data.vocab_size == model.vocab_size  # the BPE aims at the preset's words


def test_yaml_file_with_a_model_preset_and_overrides_on_top(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(
        "seed: 3\n"
        "model:\n  preset: llama-style\n  num_decoder_layers: 2\n"
        "optimizer:\n  schedule: inverse_sqrt\n  lr: 1\n  warmup_steps: 4000\n"
    )
    cfg = load_config(path, ["model.rope_scaling.factor=8", "train.batch_size=4"])
    expected_model = ModelConfig.from_preset("llama-style", num_decoder_layers=2).replace(
        rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)
    )
    assert cfg.model == expected_model and cfg.seed == 3 and cfg.train.batch_size == 4
    assert cfg.optimizer.lr == 1.0 and isinstance(cfg.optimizer.lr, float)
    assert cfg.optimizer.warmup_steps == 4000 and cfg.optimizer.schedule == "inverse_sqrt"


def test_a_partial_section_keeps_the_other_defaults():
    cfg = load_config(None, ["model.num_heads=2", "optimizer.lr=0.5"])
    assert cfg.model == TrainConfig().model.replace(num_heads=2)
    assert cfg.optimizer.warmup_steps == TrainConfig().optimizer.warmup_steps


def test_round_trip_through_plain_values():
    cfg = load_config(None, ["model.preset=llama-style"])
    assert config_from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["train.step=3"], "unknown config key 'train.step' \\(did you mean 'train.steps'\\?\\)"),
        (["optimzer.lr=3"], "did you mean 'optimizer'"),
        (["model.num_head=3"], "did you mean 'model.num_heads'"),
        (["train.steps=abc"], "train.steps must be an integer, got 'abc'"),
        (["model.num_heads=2.5"], "model.num_heads must be an integer"),
        (["optimizer.lr=fast"], "optimizer.lr must be a number"),
        (["model.scan_layers=maybe"], "model.scan_layers must be true or false"),
        (["model=3"], "model is a section"),
        (["mesh.data=0"], "mesh.data must be a positive int or -1"),
        (["mesh.data=-1", "mesh.tensor=-1"], "at most one mesh axis may be -1"),
        (["model.preset=gpt2-smal"], "did you mean 'gpt2-small'"),
        (["model.norm=batch"], "model: norm must be one of"),
        (["train.steps"], "overrides are key=value"),
        (["train.label_smoothing=1.5"], "train.label_smoothing"),
        (["checkpoint.keep=0"], "checkpoint.keep must be a positive int"),
        (["train.loss_chunk=0"], "train.loss_chunk must be a positive int"),
        (["optimizer.schedule=noam"], "optimizer.schedule must be one of"),
        # Issue 43 items 4 and 5: bounded when read, not late (islice, OverflowError, a hang).
        (["train.eval_batches=99999999999999999999"], "at most 2,147,483,647 \\(an int32\\)"),
        (["train.steps=2147483648"], "train.steps must be at most 2,147,483,647"),
        (["seed=-2147483649"], "seed must be at least -2,147,483,648"),
        (["data.eval_size=99999999999999999999"], "data.eval_size must be at most 2,147"),
        (["data.eval_size=10000001"], "^data.eval_size must be at most 10,000,000 for a synth"),
        (["data.train_size=2000000000"], "^data.train_size must be at most 10,000,000"),
    ],
)
def test_bad_overrides_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


@pytest.mark.parametrize(
    ("key", "ours"),
    [
        ("optimizer.learning_rate", "optimizer.lr"),
        ("train.learning_rate", "optimizer.lr"),
        ("learning_rate", "optimizer.lr"),
        ("model.num_layers", "model.num_decoder_layers"),
        ("model.n_layer", "model.num_decoder_layers"),
        ("data.block_size", "data.seq_len"),
        ("train.warmup_steps", "optimizer.warmup_steps"),
        ("train.max_steps", "train.steps"),
        ("batch_size", "train.batch_size"),
        ("optimizer.batch_size", "train.batch_size"),
    ],
)
def test_names_other_trainers_use_point_to_ours(key, ours):
    """Issue 45 item 3: nanoGPT's, Hugging Face's and levanter's names, in any section."""
    with pytest.raises(ConfigError, match=rf"unknown config key '{key}' \(did you mean '{ours}'"):
        load_config(None, [f"{key}=1"])
    assert set(OTHER_NAMES.values()) <= set(valid_keys())


def test_yaml_types_are_checked_too(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("train:\n  steps: '200'\n")
    with pytest.raises(ConfigError, match="train.steps must be int, got str '200'"):
        load_config(path)


@pytest.mark.parametrize(
    "text, message",
    [("train: [1, 2\n", "is not valid YAML"), ("- 1\n- 2\n", "must hold a mapping")],
)
def test_malformed_files_name_the_file(tmp_path, text, message):
    path = tmp_path / "broken.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=f"{path}.*{message}|{message}"):
        load_config(path)


def test_missing_file_names_the_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config file .*nope.yaml"):
        load_config(tmp_path / "nope.yaml")


@pytest.mark.parametrize("name", ["gpt2_small", "gpt2_small.yaml", "ablations/aft_local"])
def test_a_shipped_recipe_loads_by_name_from_anywhere(name, tmp_path, monkeypatch):
    repo = pathlib.Path(__file__).resolve().parents[1]
    monkeypatch.chdir(tmp_path)
    stem = name.removesuffix(".yaml")
    assert load_config(name) == load_config(repo / "configs" / f"{stem}.yaml")
    assert load_config(name).run_dir == f"runs/{stem}"


def test_a_file_of_a_recipe_name_is_read_before_the_recipe(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "gpt2_small").write_text("seed: 5\n")
    assert load_config("gpt2_small") == dataclasses.replace(TrainConfig(), seed=5)


def test_neither_a_file_nor_a_recipe_is_one_line_with_the_closest_recipe(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as error:
        load_config("configs/gpt2_smal.yaml")
    assert str(error.value) == (
        "cannot read config file configs/gpt2_smal.yaml: No such file or directory (did you mean "
        "'gpt2_small'? flaxformer-lite config --list names the shipped recipes)"
    )


def test_the_checkouts_configs_are_the_packages_recipes():
    """configs/ (README's paths) links to the recipes that the package ships."""
    repo = pathlib.Path(__file__).resolve().parents[1]
    shipped = recipes()
    assert {"default", "gpt2_small", "shakespeare_char", "ablations/attention"} <= set(shipped)
    files = sorted((repo / "configs").rglob("*.yaml"))
    assert [p.relative_to(repo / "configs").with_suffix("").as_posix() for p in files] == list(
        shipped
    )
    for name, path in shipped.items():
        line = summary(path)
        assert 20 <= len(line) <= 90 and line.endswith("."), (name, line)


def test_diff_and_runtime_keys():
    old = load_config(None, [])
    new = load_config(None, ["train.steps=5000", "mesh.data=2", "model.num_heads=2"])
    diff = config_diff(old, new)
    # head_dim and num_kv_heads follow num_heads: derived, they are not settings of their own.
    assert diff == {"mesh.data": (-1, 2), "model.num_heads": (4, 2), "train.steps": (3000, 5000)}
    assert [key for key in diff if not is_runtime_key(key)] == ["model.num_heads"]
    assert is_runtime_key("checkpoint.every") and is_runtime_key("run_dir")
    assert not is_runtime_key("optimizer.lr") and not is_runtime_key("train.batch_size")


def test_valid_keys_cover_every_section():
    keys = valid_keys()
    for key in (
        "run_dir",
        "seed",
        "train.steps",
        "train.batch_size",
        "train.log_every",
        "train.eval_every",
        "checkpoint.every",
        "checkpoint.keep",
        "mesh.data",
        "mesh.fsdp",
        "mesh.tensor",
        "mesh.context",
        "model.preset",
        "model.num_heads",
        "optimizer.lr",
    ):
        assert key in keys


def old_style(values: dict) -> dict:
    """``values`` as runs before the renames saved them: ``data.task`` and ``data.task_options``,
    and ``model.rope_scaling.kind``."""
    data = dict(values["data"])
    data["task"], data["task_options"] = data.pop("generator"), data.pop("generator_options")
    model = dict(values["model"])
    if model["rope_scaling"] is not None:
        scaling = dict(model["rope_scaling"])
        model["rope_scaling"] = {"kind": scaling.pop("type"), **scaling}
    return {**values, "data": data, "model": model}


def test_the_old_data_task_keys_are_read_as_data_generator_with_a_notice(tmp_path):
    path = tmp_path / "old.yaml"
    path.write_text("data:\n  task: reverse\n  task_options: {max_length: 5}\n")
    notices = []
    cfg = load_config(path, ["data.task_options.max_length=6"], notify=notices.append)
    assert cfg.data.generator == "reverse" and cfg.data.generator_options == {"max_length": 6}
    assert notices == [
        f"config file {path}: data.task is now data.generator (read as data.generator)",
        f"config file {path}: data.task_options is now data.generator_options "
        "(read as data.generator_options)",
        "data.task_options.max_length=6: data.task_options is now data.generator_options "
        "(read as data.generator_options)",
    ]
    # The new name on the command line wins over the old one in the file, as any override does.
    path.write_text("data:\n  task: reverse\n")
    assert load_config(path, ["data.generator=sentiment"]).data.generator == "sentiment"
    path.write_text("data:\n  task: reverse\n  generator: arithmetic\n")
    with pytest.raises(ConfigError, match=r"old.yaml: data.task and data.generator are one set"):
        load_config(path)


def test_a_saved_config_with_the_old_keys_loads_as_the_same_config():
    """An older run's config.yaml or checkpoint config: resuming it shows no difference."""
    llama = load_config(None, ["model.preset=llama-style"])
    assert llama.model.rope_scaling is not None
    for cfg in (TrainConfig(), load_config(None, ["data.generator=reverse", "seed=3"]), llama):
        saved = config_from_dict(old_style(cfg.to_dict()))
        assert saved == cfg and config_diff(saved, cfg) == {}


def test_the_old_rope_scaling_kind_is_read_as_its_type(tmp_path):
    path = tmp_path / "old.yaml"
    path.write_text("model:\n  positions: rope\n  rope_scaling: {kind: linear, factor: 2.0}\n")
    notices = []
    cfg = load_config(path, ["model.rope_scaling.kind=ntk"], notify=notices.append)
    assert cfg.model.rope_scaling == RopeScaling("ntk", 2.0)
    assert notices[0] == (
        f"config file {path}: model.rope_scaling.kind is now model.rope_scaling.type "
        "(read as model.rope_scaling.type)"
    )


@pytest.mark.parametrize(
    ("override", "meant"),
    [
        ("data.mixture.code.wieght=1", "data.mixture.code.weight"),
        ("evals.tasks.x.pth=a.jsonl", "evals.tasks.x.path"),
    ],
)
def test_a_misspelled_key_of_a_named_entry_is_pointed_at_the_entry_s_key(override, meant):
    mixture = ["data.source=text", "data.path=null", "data.mixture.code.path=README.md"]
    with pytest.raises(ConfigError) as error:
        load_config(None, [*mixture, override])
    assert str(error.value).endswith(f"(did you mean {meant!r}?)"), str(error.value)
