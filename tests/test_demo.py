"""demo.py, the self-checking tour of the ops and models, keeps running."""

import pathlib
import runpy

import pytest

pytestmark = pytest.mark.fast_compile  # XLA's backend optimizations off: conftest.py

REPO = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_demo_runs(capsys):
    runpy.run_path(str(REPO / "demo.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert "KV-cache decoding vs full forward" in out and "gpt2-small" in out
