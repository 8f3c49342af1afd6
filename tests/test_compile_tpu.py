"""gpt2-tiny's train step compiled for a 4-chip TPU v5e (libtpu, no TPU needed) under data=4,
fsdp=4 and fsdp=2 x tensor=2: per-chip memory, the collectives the TPU program really has, and
a program too large for the chips' 16 GiB exits 1.

XLA's CPU pipeline never emits a reduce-scatter; the TPU compiler does, which is what the
fsdp layout's gradients need.
"""

import json
import re

import jax
import pytest

from flaxformer_lite.aot import analyse, compile_for, parse_topology, prepare_host
from flaxformer_lite.cli import main
from flaxformer_lite.train.config import load_config

pytestmark = pytest.mark.slow  # each TPU compile takes 10-40 s on a 2-core CPU

LAYOUTS = {
    "data=4": ["mesh.data=4"],
    "fsdp=4": ["mesh.data=1", "mesh.fsdp=4"],
    "fsdp=2 x tensor=2": ["mesh.data=1", "mesh.fsdp=2", "mesh.tensor=2"],
}
TINY = ["train.batch_size=8", "data.seq_len=32"]


@pytest.fixture(scope="module")
def compiled():
    """Each layout's compiled program and report, compiled once for the module."""
    jax.devices()  # this session's CPU backend first: the compile leaves it alone
    v5e = parse_topology("v5e-4")
    prepare_host(v5e)
    programs = {}
    for name, overrides in LAYOUTS.items():
        program = compile_for(load_config(None, [*overrides, *TINY]), v5e)
        programs[name] = program, analyse(program, v5e)
    return programs


def test_every_layout_compiles_for_v5e_and_fits(compiled):
    for name, (program, report) in compiled.items():
        summary = report.summary()
        assert summary["topology"] == "v5e-4" and summary["chips"] == 4, name
        assert summary["fits"] is True and summary["hbm_bytes"] == 16 * 2**30
        assert program.mesh.devices.flat[0].device_kind == "TPU v5 lite"
        sizes = summary["per_chip_bytes"]
        assert sizes["total"] >= sizes["params"] + sizes["optimizer"] > 0
        assert summary["flops_per_step"] > 0 and 0 < summary["estimated_mfu"] < 1
        assert summary["attention"] == "pallas"  # the automatic choice on TPU: no dropout here
    assert compiled["fsdp=2 x tensor=2"][1].mesh == {"data": 1, "fsdp": 2, "tensor": 2}


def test_fsdp_holds_a_quarter_of_the_parameters_per_chip(compiled):
    data, fsdp = compiled["data=4"][1], compiled["fsdp=4"][1]
    # Replicated under data parallelism; split 4 ways but for the few vectors without an
    # "embed" dimension (biases of the MLP and the heads) under fsdp.
    assert 0.25 <= fsdp.params / data.params < 0.3
    assert 0.25 <= fsdp.optimizer / data.optimizer < 0.3


def test_fsdp_gathers_weights_and_reduce_scatters_gradients_as_the_report_says(compiled):
    program, report = compiled["fsdp=4"]
    hlo = program.compiled.as_text()
    counts = report.summary()["collectives"]
    assert counts["all-gather"] > 0 and counts["reduce-scatter"] > 0
    # The report's instructions are the HLO's: all-gathers, and the TPU's reduce-scatter
    # fusions (an all-reduce and a slice each).
    # A TPU async chain of fusions holds copies of one all-gather (one channel id): one gather.
    lines = [line for line in hlo.splitlines() if re.search(r" all-gather(?:-start)?\(", line)]
    chained = {re.search(r"channel_id=(\d+)", line)[1] for line in lines if "chain_id=" in line}
    gathers = len([line for line in lines if "chain_id=" not in line]) + len(chained)
    fusions = len(re.findall(r"calls=%all-reduce-scatter", hlo))
    assert report.collectives["all-gather"]["instructions"] == gathers
    assert report.collectives["reduce-scatter"]["instructions"] == fusions > 0
    data = compiled["data=4"][1].summary()["collectives"]
    assert data["all-reduce"] + data["reduce-scatter"] > 0  # the replicas' gradients


def test_tensor_parallelism_all_reduces_each_layers_activations(compiled):
    """Megatron's layout: each layer's attention and MLP outputs are summed over the tensor
    axis in the forward pass, and their inputs' gradients in the backward pass: at least 4
    all-reduces per layer per step, where data parallelism has only its gradients'."""
    layers = 2  # gpt2-tiny
    tensor = compiled["fsdp=2 x tensor=2"][1].summary()["collectives"]
    data = compiled["data=4"][1].summary()["collectives"]
    assert tensor["all-reduce"] >= 4 * layers
    assert tensor["all-reduce"] >= data["all-reduce"] + 4 * layers


def test_the_roofline_is_the_longest_of_its_times_at_v5e_published_figures(compiled):
    """Cloud TPU's v5e: 197 TFLOP/s of bf16 matmuls, 819 GB/s of HBM per chip."""
    for name, (program, report) in compiled.items():
        estimate, flops = report.estimate, program.model_flops / 4
        assert estimate.compute_seconds == pytest.approx(max(flops, report.xla_flops) / 197e12)
        assert estimate.memory_seconds * 819e9 >= report.hbm_traffic, name
        times = (estimate.compute_seconds, estimate.memory_seconds, estimate.network_seconds)
        assert estimate.step_seconds == max(times)
        assert estimate.mfu == pytest.approx(flops / (estimate.step_seconds * 197e12))
        assert 0 < estimate.mfu < 1, name  # a tiny model's step is bound by memory here


def test_a_program_larger_than_the_chips_exits_1(capsys):
    # A 2-billion-entry embedding (8 GiB of float32) with its AdamW moments, on every chip.
    argv = ["compile", "--topology", "v5e-4", "mesh.data=4", *TINY, "model.vocab_size=33554432"]
    status = main(argv)
    out = capsys.readouterr().out.strip().splitlines()
    assert status == 1
    summary = json.loads(out[-1])
    assert summary["fits"] is False
    assert summary["per_chip_bytes"]["total"] > summary["hbm_bytes"] == 16 * 2**30
    assert abs(summary["per_chip_bytes"]["params"] - 33554432 * 64 * 4) < 2**20
    assert re.match(r"does not fit: [\d.]+ GiB per chip is [\d.]+ GiB more than", out[-2])


@pytest.mark.parametrize(
    "recipe, layout",
    [("gpt2_small", ["mesh.data=4"]), ("llama_style", ["mesh.data=1", "mesh.fsdp=4"])],
)
def test_the_decoder_recipes_train_with_the_pallas_kernel_on_v5e(recipe, layout, capsys):
    """The recipe's dtype, dropout, head size and sequence length as shipped; one narrow layer
    (GQA's ratio kept), a small vocabulary and 8 rows keep the compile short."""
    shrink = ["model.num_decoder_layers=1", "model.vocab_size=1024", "train.batch_size=8"]
    shrink += ["model.d_model=256", "model.num_heads=4", "model.d_ff=512"]
    if recipe == "llama_style":
        shrink.append("model.num_kv_heads=1")
    argv = ["compile", "--config", recipe, "--topology", "v5e-4", *layout, *shrink]
    # conftest.py's "highest" precision asks the kernel for float32 products of bfloat16 blocks,
    # which Mosaic refuses; a run has the default.
    with jax.default_matmul_precision("default"):
        status = main(argv)
    out = capsys.readouterr().out.strip().splitlines()
    assert status == 0 and out[1] == "attention: pallas", out
