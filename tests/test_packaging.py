"""What ``pip install .`` gives: a wheel built from the checkout, installed in a fresh virtualenv,
runs the shipped recipes by name from an empty directory (no checkout on the path)."""

import shutil
import site
import subprocess
import sys
import venv
from pathlib import Path

import pytest
from subprocess_env import subprocess_env

from flaxformer_lite.train.recipes import recipes

REPO = Path(__file__).resolve().parents[1]


def _run(argv, cwd, env=None) -> str:
    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{argv} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The ``bin/`` of a virtualenv holding the wheel of this checkout; its dependencies are
    this interpreter's (a .pth line each: no download, and no editable install's finder)."""
    root = tmp_path_factory.mktemp("packaging")
    source = root / "source"  # a copy, so that the build leaves nothing in the checkout
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source)
    shutil.copytree(
        REPO / "flaxformer_lite",
        source / "flaxformer_lite",
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    offline = ["--no-deps", "--no-index"]  # the build and its dependencies are this interpreter's
    _run(pip + ["wheel", *offline, "--no-build-isolation", "-w", root, source], cwd=root)
    (wheel,) = root.glob("flaxformer_lite-*.whl")
    env_dir = root / "venv"
    venv.create(env_dir, with_pip=False)
    python = env_dir / "bin" / "python"
    _run(pip + ["--python", python, "install", *offline, wheel], cwd=root)
    purelib = _run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], root
    )
    Path(purelib.strip(), "dependencies.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    return env_dir / "bin"


def _env() -> dict[str, str]:
    """The test's subprocess environment without PYTHONPATH (which names the checkout)."""
    return {k: v for k, v in subprocess_env(1).items() if k != "PYTHONPATH"}


@pytest.mark.slow
def test_the_installed_package_lists_and_runs_its_recipes_by_name(installed, tmp_path):
    where = _run(
        [installed / "python", "-c", "import flaxformer_lite; print(flaxformer_lite.__file__)"],
        tmp_path,
        _env(),
    )
    assert Path(where.strip()).is_relative_to(installed.parent), where
    listing = _run([installed / "flaxformer-lite", "config", "--list"], tmp_path, _env())
    assert [line.split()[0] for line in listing.splitlines()] == list(recipes())
    shown = _run(
        [installed / "flaxformer-lite", "config", "--config", "transformer_base"], tmp_path, _env()
    )
    assert "  d_model: 512\n" in shown  # the default's is 64
    out = _run(
        [installed / "flaxformer-lite", "train", "--config", "shakespeare_char", "run_dir=run"]
        + ["train.steps=1", "train.batch_size=2", "train.eval_batches=1", "train.log_samples=0"],
        tmp_path,
        _env(),
    )
    assert "done: run" in out
    # Issue 45 item 10: the seeds' ablation is a command of the wheel, not of a checkout.
    ablation = _run([installed / "flaxformer-lite", "ablation", "--help"], tmp_path, _env())
    assert "ablations/*" in ablation and "issue" not in ablation.lower()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
