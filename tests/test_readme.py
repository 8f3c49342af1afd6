"""Every train.py / sample.py / flaxformer-lite command in README.md parses (and a training
command names a valid config).

The set-up command itself (install + the default run) is what CI's .ci/run executes."""

import argparse
import pathlib
import re
import shlex

import pytest

from flaxformer_lite.train import sample
from flaxformer_lite.train.cli import _add_train_arguments, _attention_parser
from flaxformer_lite.train.config import load_config

REPO = pathlib.Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
COMMANDS = re.findall(
    r"^\.venv/bin/(?:python train\.py|python sample\.py|flaxformer-lite) ?.*$", README, re.M
)


def test_the_readme_has_commands_and_ci_runs_the_setup_line():
    assert len(COMMANDS) >= 4
    setup = re.search(r"^python3 -m venv .*$", README, re.M).group(0)
    test = re.search(r"^\.venv/bin/python -m pytest.*$", README, re.M).group(0)
    ci = (REPO / ".ci" / "run").read_text()
    assert setup in ci and test in ci


@pytest.mark.parametrize("command", COMMANDS)
def test_readme_command_is_valid(command, tmp_path, monkeypatch):
    argv = shlex.split(command.split("#")[0])
    if argv[1:2] in (["sample.py"], ["generate"]):
        sample.parser().parse_args(argv[2:])
        return
    if argv[1:2] == ["attention"]:
        _attention_parser().parse_args(argv[2:])
        return
    if "flaxformer-lite" in argv[0]:
        assert argv[1] in ("train", "plot")
        return
    parser = argparse.ArgumentParser()
    _add_train_arguments(parser)
    args = parser.parse_intermixed_args(argv[2:])
    monkeypatch.chdir(REPO)
    cfg = load_config(args.config, args.overrides)
    assert cfg.train.steps > 0
