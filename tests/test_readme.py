"""The commands and links of the documentation stay true.

Every ``train.py`` / ``sample.py`` / ``flaxformer-lite`` command in README.md and
benchmarks/README.md parses with that command's own parser, and a training command loads a valid
config; every ``benchmarks/NAME.py`` command parses with that benchmark's parser; every Python
block of README.md and docs/reference.md runs as written, in an empty directory. README.md stays
within 250 lines and points at nothing outside the repository; every relative link and every
file path the docs name exists.

The set-up line (install + the default run) and the test line are what CI's .ci/run executes.
"""

import argparse
import contextlib
import io
import json
import pathlib
import re
import shlex

import pytest
from benchmark_scripts import load_benchmark

from flaxformer_lite import choices
from flaxformer_lite.aot import parse_topology
from flaxformer_lite.cli import generate
from flaxformer_lite.cli.ablation import parser as ablation_parser
from flaxformer_lite.cli.attention import attention_parser
from flaxformer_lite.cli.compare import compare_parser
from flaxformer_lite.cli.compile import compile_parser
from flaxformer_lite.cli.config import config_parser
from flaxformer_lite.cli.coords import coords_parser
from flaxformer_lite.cli.evaluate import evaluate_parser
from flaxformer_lite.cli.export import export_parser
from flaxformer_lite.cli.prepare import prepare_parser
from flaxformer_lite.cli.sweep import sweep_parser
from flaxformer_lite.cli.train import add_train_arguments
from flaxformer_lite.cli.transfer import transfer_parser
from flaxformer_lite.train.config import load_config
from flaxformer_lite.train.recipes import recipe_path
from flaxformer_lite.train.sweep_members import parse_vary, sweep_members

# XLA's backend optimizations off (conftest.py): the Python blocks train, decode and export
# tiny models, where compiling is most of the time; the documentation's other checks compile
# nothing.
pytestmark = pytest.mark.fast_compile

REPO = pathlib.Path(__file__).resolve().parents[1]
DOCS = {name: (REPO / name).read_text() for name in ("README.md", "benchmarks/README.md")}
README = DOCS["README.md"]
REFERENCE = (REPO / "docs" / "reference.md").read_text()
CONTRIBUTOR_DOCS = {
    **DOCS,
    "docs/design.md": (REPO / "docs" / "design.md").read_text(),
    "docs/reference.md": REFERENCE,
}
MAX_README_LINES = 250

SETUP = re.compile(r"^python3 -m venv .*$", re.M)
TESTS = re.compile(r"^\.venv/bin/python -m pytest.*$", re.M)
# A command the tests check, after any VAR=value environment assignments.
COMMAND = re.compile(
    r"^(?:[A-Z_]+=\S* )*(\.venv/bin/(?:python (?:train|sample)\.py|flaxformer-lite|"
    r"python benchmarks/\w+\.py)(?: .*)?)$"
)
SHELL_BLOCK = re.compile(r"^```(?:bash|sh)\n(.*?)^```", re.M | re.S)
PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```", re.M | re.S)
FENCED_BLOCK = re.compile(r"^```.*?^```", re.M | re.S)
CODE_SPAN = re.compile(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", re.S)  # `x`, ``` ``x`` ```
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def shell_lines(text: str) -> list[str]:
    """The lines of the shell blocks of ``text``, comments and blank lines left out."""
    lines = []
    for block in SHELL_BLOCK.findall(text):
        lines += [line for line in block.splitlines() if line.strip() and line[0] != "#"]
    return lines


def code_spans(text: str) -> list[str]:
    """The inline code of ``text`` (outside its fenced blocks), line breaks made spaces."""
    spans = CODE_SPAN.findall(FENCED_BLOCK.sub("", text))
    return [" ".join(span.split()) for _, span in spans]


def commands(text: str) -> list[str]:
    """The checked commands of ``text``: in its shell blocks and in its inline code."""
    found = [COMMAND.match(line) for line in shell_lines(text) + code_spans(text)]
    return [match.group(1) for match in found if match]


COMMANDS = [(name, command) for name, text in DOCS.items() for command in commands(text)]


def test_the_readme_has_commands_and_ci_runs_the_setup_line():
    assert len([c for name, c in COMMANDS if name == "README.md"]) >= 10
    setup, tests = SETUP.search(README).group(0), TESTS.search(README).group(0)
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    assert setup in ci and tests in ci


@pytest.mark.parametrize("name", DOCS)
def test_every_shell_line_is_a_checked_command(name):
    """A new kind of command in a shell block needs a check here first."""
    unchecked = [
        line
        for line in shell_lines(DOCS[name])
        if not (COMMAND.match(line) or SETUP.match(line) or TESTS.match(line))
    ]
    assert not unchecked, f"{name}: commands that no test checks: {unchecked}"


def test_every_benchmark_has_a_command_in_benchmarks_readme():
    scripts = {  # the runnable ones; the others are modules that they share
        path.stem
        for path in (REPO / "benchmarks").glob("*.py")
        if 'if __name__ == "__main__":' in path.read_text()
    }
    documented = {
        re.search(r"benchmarks/(\w+)\.py", command).group(1)
        for name, command in COMMANDS
        if name == "benchmarks/README.md" and "benchmarks/" in command
    }
    assert scripts <= documented, f"benchmarks without a command: {sorted(scripts - documented)}"


def _parse(parse, argv: list[str], command: str) -> argparse.Namespace:
    """``parse(argv)``, failing the test with argparse's message instead of exiting."""
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            return parse(argv)
    except SystemExit:
        pytest.fail(f"{command!r} does not parse:\n{stderr.getvalue()}")


def _gpt2_config(directory: pathlib.Path) -> None:
    """A GPT-2 ``config.json`` (tiny; no weights) where a command's ``init_from`` points."""
    directory.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": 300,
        "n_positions": 1024,
        "n_embd": 32,
        "n_layer": 2,
        "n_head": 2,
        "activation_function": "gelu_new",
    }
    (directory / "config.json").write_text(json.dumps(config))


def _config_file(config: pathlib.Path | None) -> pathlib.Path | None:
    """A command's ``--config``: a file of the repository, or a shipped recipe's name as is."""
    return config if config is None or recipe_path(config) else REPO / config


def _init_from_configs(overrides: list[str], tmp_path: pathlib.Path) -> None:
    """A GPT-2 ``config.json`` where each ``init_from=DIR`` override points."""
    for override in overrides:
        key, _, value = override.partition("=")
        if key == "init_from":
            _gpt2_config(tmp_path / value)


def _check_training_command(argv, command, tmp_path, monkeypatch):
    parser = argparse.ArgumentParser(prog="train.py")
    add_train_arguments(parser)
    args = _parse(parser.parse_intermixed_args, argv, command)
    _init_from_configs(args.overrides, tmp_path)
    config = _config_file(args.config)
    monkeypatch.chdir(tmp_path)  # relative paths of overrides resolve here
    cfg = load_config(config, args.overrides)
    assert cfg.train.steps > 0


@pytest.mark.parametrize(("name", "command"), COMMANDS)
def test_documented_command_is_valid(name, command, tmp_path, monkeypatch):
    argv = shlex.split(command, comments=True)
    program, rest = argv[0], argv[1:]
    if program.endswith("flaxformer-lite"):
        subcommand, rest = rest[0], rest[1:]
        if subcommand == "train":
            _check_training_command(rest, command, tmp_path, monkeypatch)
        elif subcommand == "generate":
            _parse(generate.parser().parse_args, rest, command)
        elif subcommand == "attention":
            _parse(attention_parser().parse_args, rest, command)
        elif subcommand == "prepare":
            args = _parse(prepare_parser().parse_intermixed_args, rest, command)
            monkeypatch.chdir(tmp_path)
            assert load_config(None, args.overrides).data.source in ("text", "jsonl", "parallel")
        elif subcommand == "sweep":
            args = _parse(sweep_parser().parse_intermixed_args, rest, command)
            _init_from_configs(args.overrides, tmp_path)
            monkeypatch.chdir(tmp_path)
            sweep_members(
                load_config(_config_file(args.config), args.overrides), parse_vary(args.vary)
            )
        elif subcommand == "compare":
            _parse(compare_parser().parse_intermixed_args, rest, command)
        elif subcommand == "config":
            args = _parse(config_parser().parse_args, rest, command)
            if not args.list:
                _check_training_command(rest, command, tmp_path, monkeypatch)
        elif subcommand == "compile":
            args = _parse(compile_parser().parse_intermixed_args, rest, command)
            parse_topology(args.topology)
            load_config(_config_file(args.config), args.overrides)
        elif subcommand == "export":
            _parse(export_parser().parse_args, rest, command)
        elif subcommand == "ablation":
            args = _parse(ablation_parser().parse_args, rest, command)
            for config in args.configs or ():
                load_config(_config_file(config), [])
        elif subcommand == "transfer":
            _parse(transfer_parser().parse_args, rest, command)
        elif subcommand == "coords":
            args = _parse(coords_parser().parse_intermixed_args, rest, command)
            monkeypatch.chdir(tmp_path)
            load_config(_config_file(args.config), args.overrides)
        elif subcommand == "evaluate":
            args = _parse(evaluate_parser().parse_intermixed_args, rest, command)
            monkeypatch.chdir(tmp_path)
            load_config(None, args.overrides)  # evals.* settings of the schema
        elif subcommand == "plot":
            assert rest in ([rest[0]], ["--run-dir", rest[-1]]), command  # plot [--run-dir] RUN
        else:
            pytest.fail(f"{name}: unknown subcommand in {command!r}")
        return
    script, rest = rest[0], rest[1:]
    if script == "train.py":
        _check_training_command(rest, command, tmp_path, monkeypatch)
    elif script == "sample.py":
        _parse(generate.parser(prog="sample.py").parse_args, rest, command)
    else:
        benchmark = pathlib.Path(script).stem
        _parse(load_benchmark(benchmark).parser().parse_args, rest, command)


def _python_blocks() -> list:
    """The Python blocks of README.md and docs/reference.md, each with where it starts."""
    return [
        pytest.param(match.group(1), id=f"{name}:{text.count(chr(10), 0, match.start()) + 2}")
        for name, text in (("README.md", README), ("docs/reference.md", REFERENCE))
        for match in PYTHON_BLOCK.finditer(text)
    ]


# A print whose line ends in a comment states what it prints: the comment up to any ";", where
# "..." stands for anything (as doctest's ELLIPSIS).
STATED_PRINT = re.compile(r"^(\s*)print\((.*)\)  # ([^;\n]*)(?:;[^\n]*)?$", re.M)


def with_stated_outputs(code: str) -> str:
    """``code`` with each ``print(...)  # OUTPUT`` checking that it prints OUTPUT."""
    return STATED_PRINT.sub(lambda m: f"{m[1]}_prints({m[3].strip()!r}, {m[2]})", code)


def _prints(stated: str, *values) -> None:
    printed = " ".join(map(str, values))
    print(printed)
    pattern = ".*".join(map(re.escape, stated.split("...")))
    assert re.fullmatch(pattern, printed), f"printed {printed!r}; the comment says {stated!r}"


@pytest.fixture
def registries_restored():
    """The library's registries of pieces as they were before the test: a block's
    ``register_mixer("talking_heads", ...)`` would otherwise replace test_pieces.py's piece of
    that name for the rest of the process."""
    registries = (
        choices.ATTENTION,
        choices.MIXERS,
        choices.POSITION_BIASES,
        choices.NORMS,
        choices.FEED_FORWARDS,
    )
    saved = [(registry.entries, dict(registry.entries)) for registry in registries]
    yield
    for entries, before in saved:
        entries.clear()
        entries.update(before)


@pytest.mark.parametrize("code", _python_blocks())
def test_python_block_runs_as_written(code, request, tmp_path, monkeypatch, registries_restored):
    """Each block defines what it uses: run alone, in a fresh namespace and an empty directory,
    leaving the registries of pieces as they were; what a print's comment says it prints, it
    prints."""
    monkeypatch.chdir(tmp_path)
    where = f"the Python block at {request.node.callspec.id}"
    namespace = {"__name__": "__readme__", "_prints": _prints}
    exec(compile(with_stated_outputs(code), where, "exec"), namespace)  # noqa: S102 - our docs


def test_a_print_that_differs_from_its_comment_fails():
    namespace = {"_prints": _prints}
    exec(with_stated_outputs("print(1 + 1, [2])  # 2 [...]; any words"), namespace)  # noqa: S102
    with pytest.raises(AssertionError, match="the comment says '3'"):
        exec(with_stated_outputs("x = 1\nprint(x + 1)  # 3"), namespace)  # noqa: S102


def test_readme_length():
    lines = len(README.splitlines())
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines (at most {MAX_README_LINES})"


def test_readme_points_at_nothing_outside_the_repository():
    assert "../" not in README


@pytest.mark.parametrize("name", CONTRIBUTOR_DOCS)
def test_relative_links_point_at_files_of_the_repository(name):
    doc = REPO / name
    for target in LINK.findall(CONTRIBUTOR_DOCS[name]):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue  # a web address or an anchor of this page
        path = (doc.parent / target.split("#")[0]).resolve()
        assert path.is_relative_to(REPO), f"{name} links {target}, outside the repository"
        assert path.exists(), f"{name} links {target}, which does not exist"


@pytest.mark.parametrize("name", CONTRIBUTOR_DOCS)
def test_named_source_files_exist(name):
    """A file path in code (``train/step.py``, ``configs/default.yaml``) names a file of the
    repository, from its root or from the package's."""
    for span in code_spans(CONTRIBUTOR_DOCS[name]):
        if re.fullmatch(r"[\w.-]+(?:/[\w.-]+)+\.(?:py|yaml|md)", span):
            assert (REPO / span).exists() or (REPO / "flaxformer_lite" / span).exists(), (
                f"{name} names {span}, which does not exist"
            )
