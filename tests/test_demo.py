"""demo.py, the self-checking tour of the ops and models: its checks pass, and one that fails is
named and ends the demo with status 1."""

import pathlib
import runpy

import pytest

from flaxformer_lite import ops

pytestmark = pytest.mark.fast_compile  # XLA's backend optimizations off: conftest.py

REPO = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_demo_names_a_failed_check_and_exits_1(capsys, monkeypatch):
    """One run with a layer norm off by 1e-4 (ten times the check's tolerance): that check
    fails and is named, every other check passes."""
    layer_norm = ops.layer_norm
    monkeypatch.setattr(ops, "layer_norm", lambda x, **kwargs: layer_norm(x, **kwargs) + 1e-4)
    with pytest.raises(SystemExit) as ended:
        runpy.run_path(str(REPO / "demo.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert ended.value.code == 1
    assert "FAILED layer_norm" in out and "1 of 13 checks failed: layer_norm" in out
    assert out.count("\nok ") == 12 and "gpt2-small size" in out
