"""benchmarks/context.py: the longest fitting sequence per context size, and context 8 against
data 8 at the same tokens on 8 CPU devices."""

import json

import pytest
from benchmark_scripts import load_benchmark

pytestmark = pytest.mark.fast_compile  # XLA's backend optimizations off: conftest.py

GIB = 2**30


def fake_compile(arguments: list[str]) -> dict:
    """A compile whose total per chip is one GiB per 1,024 tokens per chip (``T / C``), refused
    (no collectives) above v5e's 16 GiB."""
    settings = dict(a.split("=", 1) for a in arguments if "=" in a)
    length, context = int(settings["data.seq_len"]), int(settings["mesh.context"])
    total = length // context / 1024 * GIB
    sizes = {"params": 0, "optimizer": 0, "temp": total, "total": total}
    mesh = {"data": 1, "fsdp": int(settings["mesh.fsdp"]), "context": context, "tensor": 1}
    return {"command": " ".join(arguments), "compile_seconds": 0.0, "mesh": mesh} | {
        "per_chip_bytes": sizes,
        "fits": total <= 16 * GIB,
        "collectives": {} if total <= 16 * GIB else None,
    }


def test_longest_fitting_doubles_while_it_fits_and_halves_while_it_does_not():
    benchmark = load_benchmark("context")
    tried = []

    def row(length):
        tried.append(length)
        return length

    assert benchmark.longest_fitting(row, 64, 4096, lambda n: n <= 300) == 256
    assert tried == [64, 128, 256, 512]
    tried.clear()
    assert benchmark.longest_fitting(row, 1024, 4096, lambda n: n <= 300) == 256
    assert tried == [1024, 512, 256]
    assert benchmark.longest_fitting(row, 64, 128, lambda n: True) == 128  # the limit
    assert benchmark.longest_fitting(row, 4, 128, lambda n: False) is None


def test_memory_sweep_finds_each_context_its_length_and_keeps_its_rows(
    tmp_path, capsys, monkeypatch
):
    benchmark = load_benchmark("context")
    monkeypatch.setattr(benchmark.compile_table, "compile_command", fake_compile)
    out = tmp_path / "rows.jsonl"
    argv = ["memory", "--out", str(out), "--start", "8192", "--contexts", "1", "2", "8"]
    summary = benchmark.main([*argv, "--budget-gib", "12"])
    # 12 GiB holds 8,192 tokens per chip (8 GiB) and not 16,384: T = 8,192 x C.
    assert summary["longest"] == {1: 8192, 2: 16384, 8: 65536}
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["context"], r["length"], r["sequences"]) for r in rows] == [
        (1, 8192, 8),
        (1, 16384, 8),
        (2, 16384, 4),
        (2, 32768, 4),
        (8, 65536, 1),
        (8, 131072, 1),
    ]
    assert "mesh.fsdp=4 mesh.context=2 train.batch_size=4" in rows[2]["command"]
    printed = capsys.readouterr().out.splitlines()
    assert json.loads(printed[-1])["longest"] == {"1": 8192, "2": 16384, "8": 65536}
    assert "| 2 | 4 x 2 | 16,384 x 4 | 8,192 | 0.00 + 0.00 + 8.00 = 8.00 | yes |" in printed
    assert "| 8 | 65,536 | 8x |" in printed

    # Again without a budget: the chip's own verdict (16 GiB), every row but the new read back.
    compiled = []
    monkeypatch.setattr(
        benchmark.compile_table,
        "compile_command",
        lambda arguments: compiled.append(arguments) or fake_compile(arguments),
    )
    assert benchmark.main(argv)["longest"] == {1: 16384, 2: 32768, 8: 131072}
    assert len(compiled) == 3  # 32,768, 65,536 and 262,144 tokens: new lengths
    printed = capsys.readouterr().out.splitlines()
    assert "| 1 | 8 x 1 | 16,384 x 8 | 16,384 | 0.00 + 0.00 + 16.00 = 16.00 | yes |" in printed
    assert "| 8 | 1 x 8 | 262,144 x 1 | 32,768 | 0.00 + 0.00 + 32.00 asked | **no** |" in printed


@pytest.mark.slow
def test_context_and_data_parallel_steps_are_timed_side_by_side(capsys):
    summary = load_benchmark("context").main(["time", "--quick"])
    printed = capsys.readouterr().out.splitlines()
    assert json.loads(printed[-1]) == json.loads(json.dumps(summary))
    context, data = summary["context"], summary["data"]
    assert context["sequences"] * context["length"] == data["sequences"] * data["length"]
    assert (context["sequences"], data["sequences"]) == (1, 8)
    assert len(context["seconds"]) == len(data["seconds"]) == 2
    assert all(s > 0 for s in context["seconds"] + data["seconds"])
    ratios = [c / d for c, d in zip(context["seconds"], data["seconds"], strict=True)]
    assert min(ratios) <= summary["ratio"] <= max(ratios)
    table = [line for line in printed if line.startswith("| context 8") or "| data 8" in line]
    assert len(table) == 2 and table[1].endswith("| 1.00x | 1.00x |")
    assert context["flops"] > data["flops"]  # a causal sequence 8x as long: more keys a query
