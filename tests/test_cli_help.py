"""The commands explain themselves: ``--help`` of every command (what it does, an example),
one flag style with the old underscore spellings as aliases, and ``--show-config`` /
``flaxformer-lite config``, whose YAML loads back as the config it shows."""

import dataclasses
import os
import re
import subprocess
import sys
import typing

import pytest
import yaml

from flaxformer_lite.cli import COMMANDS, entry_point, main
from flaxformer_lite.cli import generate as generate_cli
from flaxformer_lite.cli.attention import attention_parser
from flaxformer_lite.cli.train import train_main
from flaxformer_lite.settings import help_of, setting
from flaxformer_lite.train.config import TrainConfig, config_from_dict, load_config
from flaxformer_lite.train.config_help import annotated_yaml, help_lines, leaf_keys, type_name
from flaxformer_lite.train.recipes import recipes, summary

REPO_CONFIGS = ["configs/default.yaml", "configs/transformer_tiny.yaml", "configs/bert_tiny.yaml"]
# Each command's function, its module imported here (the quick tier's files import every module).
ENTRY_POINTS = {name: entry_point(name) for name in COMMANDS}


def help_text(argv, capsys) -> str:
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 0
    return capsys.readouterr().out


def test_top_level_help_lists_every_command_with_what_it_does(capsys):
    text = help_text(["--help"], capsys)
    for name, what in COMMANDS.items():
        assert re.search(rf"^  {name} +{re.escape(what)}$", text, re.M), name
    assert "examples:" in text


@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_command_runs_its_modules_main(command):
    function = ENTRY_POINTS[command]
    assert (function.__module__, function.__name__) == (
        f"flaxformer_lite.cli.{command}",
        f"{command}_main",
    )


@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_command_help_says_what_it_does_with_an_example(command, capsys):
    text = help_text([command, "--help"], capsys)
    description = text.split("\n\n")[1]
    assert len(description.split()) >= 8, description
    example = text.split("example")[-1]
    assert f"flaxformer-lite {command}" in example or "train.py" in example, text


def test_help_imports_no_library_only_some_commands_use():
    """Every command's --help, and the listing's: no JAX, Flax or Optax either (the commands
    import them when they run), also where libtpu makes the package check for TPU chips."""
    code = (
        "import sys\n"
        "from flaxformer_lite.cli import COMMANDS, main\n"
        "for argv in (['--help'], *([name, '--help'] for name in COMMANDS)):\n"
        "    try:\n"
        "        main(argv)\n"
        "    except SystemExit:\n"
        "        pass\n"
        "heavy = ('jax', 'flax', 'optax', 'matplotlib', 'orbax', 'transformers', 'tokenizers',\n"
        "         'sacrebleu', 'torch')\n"
        "print(*[name for name in heavy if name in sys.modules])"
    )
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    child = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert child.returncode == 0, child.stderr
    assert child.stdout.splitlines()[-1] == "", child.stdout


def test_flags_use_dashes_and_the_underscore_spellings_stay_aliases():
    parser = generate_cli.parser()
    dashed = parser.parse_args(
        ["--run-dir", "r", "--prompt", "1+1=", "--max-new-tokens", "5", "--top-p", "0.9"]
        + ["--top-k", "3", "--num-samples", "2", "--min-tokens-to-keep", "2"]
    )
    old = parser.parse_args(
        ["--run_dir", "r", "--prompt", "1+1=", "--max_new_tokens=5", "--top_p", "0.9"]
        + ["--top_k", "3", "--num_samples", "2", "--min_tokens_to_keep", "2"]
    )
    assert vars(dashed) == vars(old)
    assert dashed.max_new_tokens == 5 and dashed.min_tokens_to_keep == 2
    beam = parser.parse_args(["--hf_dir", "h", "--prompt", "x", "--beam_size", "4", "--n_best=2"])
    assert (beam.beam_size, beam.n_best, str(beam.hf_dir)) == (4, 2, "h")
    assert str(attention_parser().parse_args(["--run_dir", "r", "--text", "t"]).run_dir) == "r"
    for parser in (generate_cli.parser(), attention_parser()):
        flags = [s for a in parser._actions for s in a.option_strings if s.startswith("--")]
        assert not [flag for flag in flags if "_" in flag], flags


def test_show_config_of_the_defaults_loads_back_as_the_defaults(capsys):
    assert train_main(["--show-config"]) == 0
    text = capsys.readouterr().out
    assert config_from_dict(yaml.safe_load(text)) == TrainConfig()
    assert yaml.safe_load(text) == TrainConfig().to_dict()


def test_show_config_has_every_key_with_its_type_default_and_help(capsys):
    assert main(["config", "train.steps=7", "optimizer.lr=0.01"]) == 0
    lines = capsys.readouterr().out.splitlines()
    defaults, helps = TrainConfig(), help_lines()
    for key, annotation in leaf_keys().items():
        *section, name = key.split(".")
        at = [i for i, line in enumerate(lines) if line.strip().startswith(f"{name}:")]
        comments = [lines[i - 1].strip() for i in at]
        wanted = f"# {type_name(annotation)}, default "
        assert any(c.startswith(wanted) and c.endswith(helps[key]) for c in comments), key
    shown = config_from_dict(yaml.safe_load("\n".join(lines)))
    assert shown == dataclasses.replace(
        defaults,
        train=dataclasses.replace(defaults.train, steps=7),
        optimizer=dataclasses.replace(defaults.optimizer, lr=0.01),
    )
    assert "# int, default 3000: " in "\n".join(lines)  # the default, not the value shown


@pytest.mark.parametrize("path", REPO_CONFIGS)
def test_show_config_of_a_preset_file_round_trips(path):
    cfg = load_config(path)
    assert config_from_dict(yaml.safe_load(annotated_yaml(cfg))) == cfg


def test_train_py_show_config_equals_the_config_command(capsys):
    assert train_main(["--show-config", "--config", "configs/default.yaml", "seed=3"]) == 0
    from_train = capsys.readouterr().out
    assert main(["config", "--config", "configs/default.yaml", "seed=3"]) == 0
    assert capsys.readouterr().out == from_train


def test_config_list_names_each_shipped_recipe_with_its_line(capsys):
    assert main(["config", "--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split("  ")[0].strip() for line in lines] == list(recipes())
    default = next(line for line in lines if line.startswith("default "))
    assert default.split(None, 1)[1] == summary(recipes()["default"])
    assert "gpt2-tiny learning three-digit arithmetic" in default


def test_config_list_onto_a_full_disk_is_one_line_and_exit_2():
    """Issue 43 item 13: --list was not guarded like the other commands (a traceback)."""
    code = "import sys; from flaxformer_lite.cli import main; sys.exit(main(['config', '--list']))"
    with open("/dev/full", "w") as full:
        child = subprocess.run([sys.executable, "-c", code], stdout=full, stderr=subprocess.PIPE)
    assert child.returncode == 2, child.stderr
    assert child.stderr.decode() == "error: [Errno 28] No space left on device\n"


def test_config_of_a_recipe_by_name_shows_that_recipe(capsys):
    assert main(["config", "--config", "shakespeare_char"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["run_dir"] == "runs/shakespeare_char"


def test_show_config_with_a_bad_key_exits_2_naming_it(capsys):
    assert train_main(["--show-config", "train.stepz=3"]) == 2
    assert "train.steps" in capsys.readouterr().err


def test_the_old_data_task_key_gives_one_line_naming_the_new_one(capsys):
    assert main(["config", "data.task=reverse"]) == 0
    out, err = capsys.readouterr()
    assert err.splitlines() == [
        "notice: data.task=reverse: data.task is now data.generator (read as data.generator)"
    ]
    assert load_config(None, ["data.generator=reverse"]) == config_from_dict(yaml.safe_load(out))


def test_every_config_field_has_its_help_beside_it():
    """Each field of each section, nested ones too, declares its help (settings.setting): a
    field added without it fails here."""

    def fields(cls, prefix=""):
        hints = typing.get_type_hints(cls)
        for field in dataclasses.fields(cls):
            yield prefix + field.name, field
            if dataclasses.is_dataclass(hints[field.name]):
                yield from fields(hints[field.name], f"{prefix}{field.name}.")

    missing = [key for key, field in fields(TrainConfig) if not help_of(field)]
    assert not missing, f"config fields without help: {missing}"
    assert set(help_lines()) == {key for key, _ in fields(TrainConfig)}

    @dataclasses.dataclass(frozen=True)
    class Section:
        kept: int = setting(1, help="a field with its help")
        added: int = 2

    with pytest.raises(TypeError, match="config key added has no help"):
        help_lines(Section)
