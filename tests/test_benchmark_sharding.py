"""benchmarks/sharding.py on gpt2-tiny: fsdp shards the state, data parallelism all-reduces."""

import json

import pytest
from benchmark_scripts import load_benchmark

pytestmark = pytest.mark.fast_compile  # XLA's backend optimizations off: conftest.py


@pytest.mark.slow
def test_sharding_benchmark_on_gpt2_tiny(capsys):
    benchmark = load_benchmark("sharding")
    argv = ["--preset", "gpt2-tiny", "--batch", "8", "--seq", "32", "--layouts", "data=8", "fsdp=8"]
    rows = benchmark.main(argv)
    out = capsys.readouterr().out.strip().splitlines()

    summary = json.loads(out[-1])
    assert summary["rows"] == json.loads(json.dumps(rows))
    by_layout = {row["layout"]: row for row in summary["rows"]}
    data, fsdp = by_layout["data=8"], by_layout["fsdp=8"]
    assert data["fraction"] == 1.0
    assert fsdp["param_bytes"] < data["param_bytes"] / 4
    assert fsdp["total_bytes"] < data["total_bytes"] / 4
    assert data["collectives"]["all-reduce"]["instructions"] >= 1
    assert fsdp["collectives"]["all-gather"]["instructions"] >= 1

    # The markdown table: a header, a separator and one row per layout, the numbers of the JSON.
    table = [line for line in out if line.startswith("|")]
    assert len(table) == 4
    cells = {line.split("|")[1].strip(): line.split("|")[2:-1] for line in table[2:]}
    assert float(cells["data=8"][0]) == round(data["param_bytes"] / 2**20, 1)
    assert int(cells["data=8"][4]) == data["collectives"]["all-reduce"]["instructions"]
    assert not [line for line in out if line.startswith("FAIL")]
