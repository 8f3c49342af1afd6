"""muP's coordinate check (``flaxformer-lite coords``): with a large Adam learning rate the
standard parametrization's hidden outputs and logits grow with the width within two steps, muP's
do not; at init the two differ as their rules say; the command writes its figure and record into
a new directory only."""

import json

import pytest

from flaxformer_lite.cli.coords import coords_main
from flaxformer_lite.train.config import load_config
from flaxformer_lite.train.coord_check import coord_check, group_of, panel_steps

pytestmark = pytest.mark.fast_compile  # XLA's backend optimizations off: conftest.py

WIDTHS = [32, 64, 128]
# A large constant rate, whose first steps already move the standard parametrization's wide
# models more than its narrow ones.
TINY = [
    "model.num_decoder_layers=1",
    "data.seq_len=8",
    "optimizer.lr=1e-2",
    "optimizer.schedule=constant",
    "optimizer.warmup_steps=0",
]
MUP = ["model.parametrization=mup", f"model.mup_base_width={WIDTHS[0]}"]


@pytest.fixture(scope="module")
def results():
    """The standard's and muP's checks of the tiny default model, 2 steps, 1 seed."""
    return {
        name: coord_check(load_config(None, TINY + extra), WIDTHS, steps=2, seeds=1, batch_size=4)
        for name, extra in (("standard", []), ("mup", MUP))
    }


def growth(result: dict, group: str, step: int) -> float:
    """``mean |x|`` of ``group`` at the widest width over that at the narrowest, at ``step``."""
    table = result["scales"][group]
    return table[-1][step] / table[0][step]


def test_the_record_has_every_group_at_every_width_and_step(results):
    for name, result in results.items():
        assert result["parametrization"] == name
        assert result["widths"] == WIDTHS and result["steps"] == [0, 1, 2]
        assert set(result["scales"]) == {
            "embed/tokens",
            "embed/positions",
            "layers/self_attention/qkv",
            "layers/self_attention/out",
            "layers/mlp/wi",
            "layers/mlp/wo",
            "layers/output",
            "logits",
        }
        for table in [*result["scales"].values(), result["loss"]]:
            assert [len(row) for row in table] == [3, 3, 3]
            assert all(value > 0 for row in table for value in row)


@pytest.mark.parametrize("group", ["layers/output", "logits"])
def test_the_standard_grows_with_the_width_after_steps_and_mup_does_not(results, group):
    standard, mup = growth(results["standard"], group, -1), growth(results["mup"], group, -1)
    assert standard > 1.5, standard
    assert mup < 1.25, mup
    assert standard > 2 * mup, (standard, mup)


def test_at_init_a_hidden_output_grows_as_the_root_of_the_width_only_under_the_standard(results):
    # A fixed init std (gpt2's 0.02) sums 4x as many inputs at 4x the width; muP's m^-1/2 on it
    # holds the output.
    assert growth(results["standard"], "layers/mlp/wi", 0) == pytest.approx(2.0, rel=0.15)
    assert growth(results["mup"], "layers/mlp/wi", 0) == pytest.approx(1.0, rel=0.15)
    # The token table is muP's input role: the same init at every width.
    assert growth(results["mup"], "embed/tokens", 0) == pytest.approx(1.0, rel=0.15)


def test_groups_name_a_layers_modules_without_its_index():
    assert group_of(("decoder", "layers", "layers", 3, "mlp", "wo"), object()) == "layers/mlp/wo"
    assert group_of(("decoder", "layers", "layers", 0), object()) == "layers/output"
    assert group_of(("embed", "tokens"), object()) == "embed/tokens"
    assert panel_steps(list(range(5))) == [0, 1, 2, 3, 4]
    many = panel_steps(list(range(21)), most=5)
    assert many[0] == 0 and many[-1] == 20 and len(many) == 5


def test_a_model_that_is_not_a_decoder_lm_or_a_base_above_a_width_is_refused():
    with pytest.raises(ValueError, match="'encoder'"):
        coord_check(load_config("bert_tiny"), WIDTHS, steps=1, seeds=1)
    with pytest.raises(ValueError, match="mup_base_width"):
        coord_check(
            load_config(None, [*TINY, "model.parametrization=mup", "model.mup_base_width=64"]),
            WIDTHS,
        )


def test_the_command_writes_into_a_new_directory_and_refuses_one_that_holds_files(tmp_path, capsys):
    out = tmp_path / "coords"
    flags = ["--widths", "32,64", "--steps", "1", "--seeds", "1", "--batch-size", "4"]
    assert coords_main([*flags, "--out", str(out), *TINY]) == 0
    printed = capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == ["coord_check.json", "coord_check.png"]
    assert (out / "coord_check.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    record = json.loads((out / "coord_check.json").read_text())
    assert record["widths"] == [32, 64] and record["steps"] == [0, 1]
    assert "layers/output" in printed and f"wrote {out / 'coord_check.png'}" in printed
    assert "mean |x| of each module's output on the fixed batch after" in printed
    assert f"over the layers and {record['seeds']} seed(s)" in printed
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}

    assert coords_main([*flags, "--out", str(out), *TINY]) == 2
    error = capsys.readouterr().err
    assert error.startswith("error: --out") and "new or empty directory" in error
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before
