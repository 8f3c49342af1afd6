"""benchmarks/compile_table.py: rows compiled in processes of their own, kept, and tabulated."""

import json

import pytest
from benchmark_scripts import load_benchmark

# gpt2-small shrunk: one layer of width 64 over a vocabulary of 512, a batch of 8 rows of 32.
SHRUNK = [
    "model.num_decoder_layers=1",
    "model.d_model=64",
    "model.num_heads=2",
    "model.d_ff=128",
    "model.vocab_size=512",
    "data.seq_len=32",
    "train.batch_size=8",
]


def gpt2_parameters(vocab=512, positions=1024, d=64, f=128, layers=1) -> int:
    """GPT-2's parameters, counted by hand: tied token embedding, learned positions, and per
    layer two LayerNorms, fused QKV, the output projection and the MLP, all with biases."""
    layer = 2 * 2 * d + (d * 3 * d + 3 * d) + (d * d + d) + (d * f + f) + (f * d + d)
    return vocab * d + positions * d + layers * layer + 2 * d


@pytest.mark.slow
def test_rows_are_compiled_once_kept_and_tabulated(tmp_path, capsys, monkeypatch):
    benchmark = load_benchmark("compile_table")
    out = tmp_path / "rows.jsonl"
    argv = ["--out", str(out), "--topologies", "cpu-8", "--models", "gpt2-small"]
    benchmark.main([*argv, "--layouts", "data", "--set", *SHRUNK])
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert (row["model"], row["topology"], row["layout"]) == ("gpt2-small", "cpu-8", "data")
    assert row["mesh"] == {"data": 8, "fsdp": 1, "tensor": 1}
    assert row["per_chip_bytes"]["params"] == 4 * gpt2_parameters()  # float32, replicated
    assert row["per_chip_bytes"]["optimizer"] >= 2 * row["per_chip_bytes"]["params"]  # AdamW
    assert row["collectives"]["all-reduce"] >= 1 and row["attention"] == "xla"
    assert row["command"].startswith("flaxformer-lite compile --config gpt2_small --topology cpu-8")
    table = [line for line in capsys.readouterr().out.splitlines() if line.startswith("|")]
    assert len(table) == 3 and table[2].startswith("| gpt2-small | cpu-8 | 8 x 1 x 1 | 0.00 +")

    # A second run compiles only the row that is new and tabulates both.
    compiled = []
    monkeypatch.setattr(
        benchmark, "compile_row", lambda *key: compiled.append(key) or {**row, "layout": key[2]}
    )
    benchmark.main([*argv, "--layouts", "data", "fsdp", "--set", *SHRUNK])
    assert compiled == [("gpt2-small", "cpu-8", "fsdp", SHRUNK)]
    assert len(out.read_text().splitlines()) == 2
    assert len([line for line in capsys.readouterr().out.splitlines() if line[:1] == "|"]) == 4

    # A row that failed is compiled again; a row of other overrides is another row.
    failed = {"model": "gpt2-small", "topology": "cpu-8", "layout": "fsdp x tensor", "set": SHRUNK}
    with out.open("a") as rows:
        rows.write(json.dumps({**failed, "error": "no libtpu"}) + "\n")
    compiled.clear()
    benchmark.main([*argv, "--layouts", "fsdp x tensor", "--set", *SHRUNK])
    benchmark.main([*argv, "--layouts", "data", "--set", *SHRUNK, "train.batch_size=16"])
    assert compiled == [
        ("gpt2-small", "cpu-8", "fsdp x tensor", SHRUNK),
        ("gpt2-small", "cpu-8", "data", [*SHRUNK, "train.batch_size=16"]),
    ]


def test_a_refused_or_failed_row_says_so():
    benchmark = load_benchmark("compile_table")
    refused = {
        "model": "llama-style",
        "topology": "v5e-8",
        "layout": "data",
        "mesh": {"data": 8, "fsdp": 1, "tensor": 1},
        "per_chip_bytes": {"params": 2**30, "optimizer": 2**31, "temp": 2**32, "total": 7 * 2**30},
        "fits": False,
        "collectives": None,
    }
    line = benchmark.table_line(refused)
    assert "| 1.00 + 2.00 + 4.00 = 7.00 | **no** | refused by the compiler |" in line
    failed = {"model": "gpt2-small", "topology": "h100-8", "layout": "fsdp", "error": "no plugin"}
    assert "| gpt2-small | h100-8 | fsdp | failed: no plugin |" in benchmark.table_line(failed)


def test_counts_with_a_loop_of_unknown_length_are_lower_bounds():
    row = {
        "model": "gpt2-small",
        "topology": "v5e-8",
        "layout": "fsdp",
        "mesh": {"data": 1, "fsdp": 8, "tensor": 1},
        "per_chip_bytes": {"params": 0, "optimizer": 0, "temp": 0, "total": 0},
        "fits": True,
        "collectives": {"all-reduce": 3, "all-gather": 0, "collective-permute": 7},
        "collectives_exact": False,
        "attention": "pallas",
        "estimated_step_seconds": 0.1,
        "estimated_mfu": 0.25,
    }
    line = load_benchmark("compile_table").table_line(row)
    assert "| at least AR 3 CP 7 | pallas | 100 | 25% |" in line
