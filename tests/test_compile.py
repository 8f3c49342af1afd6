"""``flaxformer-lite compile``: topology names, the HLO's collectives, exit statuses, ``cpu-N``.

The TPU programs themselves (gpt2-tiny on a 4-chip v5e) are compiled in test_compile_tpu.py.
"""

import json
import pathlib
import subprocess
import sys

import jax
import pytest
from subprocess_env import subprocess_env

from flaxformer_lite.aot import (
    TopologyError,
    abstract_batch,
    collective_counts,
    parse_topology,
    topology,
)
from flaxformer_lite.cli import main
from flaxformer_lite.data import tasks
from flaxformer_lite.train.config import load_config

pytestmark = pytest.mark.fast_compile  # XLA's backend optimizations off: conftest.py

TINY = ["train.batch_size=8", "data.seq_len=16"]
CONFIGS = pathlib.Path(__file__).resolve().parents[1] / "configs"
SUMMARY_KEYS = {
    "topology",
    "chips",
    "mesh",
    "per_chip_bytes",
    "hbm_bytes",
    "fits",
    "flops_per_step",
    "xla_flops_per_program",
    "optimizer_flops_per_step",
    "collectives",
    "collectives_exact",
    "attention",
    "estimated_step_seconds",
    "estimated_mfu",
}


@pytest.mark.parametrize(
    ("name", "chips", "libtpu_name"),
    [
        ("v5e-8", 8, "v5e:2x4"),
        ("v5e-4", 4, "v5e:2x2"),
        ("v5e-256", 256, "v5e:16x16"),
        ("v6e-8", 8, "v6e:2x4"),
        ("v5p-8", 4, "v5:2x2x1"),  # v5p and v4 count cores, two per chip
        ("v5p-128", 64, "v5:4x4x4"),
        ("v4-8", 4, "v4:2x2x1"),
        ("v4-32", 16, "v4:2x2x4"),
        ("v5e:2x4", 8, "v5e:2x4"),
        ("v5p:4x4x12", 192, "v5:4x4x12"),
    ],
)
def test_topology_names_follow_maxtext(name, chips, libtpu_name):
    slice_ = parse_topology(name)
    assert (slice_.platform, slice_.chips, slice_.libtpu_name) == ("tpu", chips, libtpu_name)


def test_cpu_topology_and_chip_figures():
    assert parse_topology("cpu-4") == topology.Topology("cpu-4", "cpu", 4)
    v5e = topology.CHIPS["v5e"]
    assert v5e.hbm_bytes == 16 * 2**30 and v5e.peak_flops == 197e12
    assert v5e.ring_bytes_per_s == 200e9  # two of four ports, both directions


def test_the_report_says_what_its_numbers_assume():
    """Issue 45 item 7: a compute-bound estimate reads MFU 100% by construction; permutes stand
    for FSDP's collectives on TPUs; XLA's FLOPs count a loop body once. Said where printed."""
    from flaxformer_lite.aot.hlo import COLLECTIVES
    from flaxformer_lite.aot.report import Report, _roofline

    chip = topology.CHIPS["v5p"]
    counts = {op: dict(instructions=0, executed=0, bytes=0, exact=True) for op in COLLECTIVES}
    counts["collective-permute"] = dict(instructions=9, executed=2448, bytes=2**30, exact=True)
    estimate = _roofline(
        chip_flops=12e12, optimizer_flops=0.0, xla_flops=1e12, traffic=1e9, sent=2**30, chip=chip
    )
    report = Report(
        topology=parse_topology("v5p-8"),
        program="train step",
        mesh={"data": 1, "fsdp": 4, "tensor": 1},
        attention="xla",
        params=0,
        optimizer=0,
        temp=0,
        total=0,
        hbm=chip.hbm_bytes,
        xla_flops=1e12,
        model_flops=4 * 12e12,
        optimizer_flops=0.0,
        hbm_traffic=1e9,
        collectives=counts,
        estimate=estimate,
    )
    text = "\n".join(report.lines())
    assert "MFU at most 100.0%; bound by compute (the FLOPs at the chip's bf16 peak)" in text
    assert "assumed fully overlapped" in text
    assert "XLA's count is 12x lower: it counts a loop's body once" in text
    assert "decomposes FSDP's all-gathers and reduce-scatters" in text


@pytest.mark.parametrize(
    ("name", "shape"), [("h100-1", (1, 1, 1)), ("h100-8", (1, 1, 8)), ("h100-32", (1, 4, 8))]
)
def test_h100_names_count_gpus_eight_a_host(name, shape):
    slice_ = parse_topology(name)
    assert (slice_.platform, slice_.chip.name, slice_.shape) == ("cuda", "h100", shape)
    assert slice_.chips == shape[1] * shape[2]


def test_h100_without_the_cuda_plugin_says_what_to_install(monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "jax_plugins.xla_cuda12" else find_spec(name, *a),
    )
    with pytest.raises(TopologyError, match=r"pip install .*jax-cuda12-plugin==.*gpu-compile"):
        topology.topology_devices(parse_topology("h100-8"))


@pytest.mark.slow
def test_the_train_step_compiles_for_h100s_without_a_gpu(tmp_path):
    """With jax's CUDA plugin and cuDNN installed (the gpu-compile extra; skipped without): the
    command compiles the step for 8 H100s, its attention in cuDNN, on this CPU host."""
    pytest.importorskip("jax_plugins.xla_cuda12")
    pytest.importorskip("nvidia.cudnn")
    main_ = "import sys; from flaxformer_lite.cli import main; sys.exit(main())"
    command = [sys.executable, "-c", main_, "compile", "--topology", "h100-8"]
    command += [*TINY, "model.dtype=bfloat16", "model.attention_dropout=0.0", "mesh.data=2"]
    command += ["mesh.fsdp=4"]
    env = subprocess_env(1, JAX_PLATFORMS="cpu")
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert (summary["topology"], summary["chips"], summary["fits"]) == ("h100-8", 8, True)
    assert summary["attention"] == "cudnn" and summary["flops_per_step"] > 0
    assert summary["collectives"]["reduce-scatter"] > 0  # fsdp's gradients


@pytest.mark.parametrize(
    "name", ["v9-8", "v5e-6", "v5p-7", "v5e:2x2x2", "cpu-0", "gpu", "h100-12", ""]
)
def test_unknown_topologies_are_refused(name):
    with pytest.raises(TopologyError, match="topology"):
        parse_topology(name)


@pytest.mark.parametrize(
    "config, overrides, task, packed",
    [
        (None, [], "lm", True),
        (None, ["data.packing=false"], "lm", False),
        ("transformer_tiny.yaml", [], "seq2seq", False),
        ("bert_tiny.yaml", ["model.num_classes=null"], "mlm", False),
        ("bert_tiny.yaml", [], "classify", False),
    ],
)
def test_the_abstract_batch_is_the_tasks_description(config, overrides, task, packed):
    cfg = load_config(config and CONFIGS / config, [*TINY, *overrides])
    batch = abstract_batch(cfg, None)
    wanted = tasks.task_named(task).batch_shapes(packed=packed, batch_size=8, seq_len=16)
    assert {key: (array.shape, array.dtype) for key, array in batch.items()} == wanted


@pytest.fixture(autouse=True)
def _backend_started():
    """The command's host settings (device count, platforms) apply only before JAX starts a
    backend: started here, they leave this test session's 8 CPU devices alone."""
    jax.devices()


HLO = """\
HloModule step, entry_computation_layout={()->f32[]}

%all-reduce-scatter.1 (input.1: f32[64,32]) -> f32[16,32] {
  %input.1 = f32[64,32]{1,0} parameter(0)
  %all-reduce.2 = f32[64,32]{1,0} all-reduce(%input.1), replica_groups={{0,1,2,3}}, to_apply=%add
  ROOT %dynamic-slice.3 = f32[16,32]{1,0} dynamic-slice(%all-reduce.2, %c, %c)
}

%body (p: (s32[], f32[16,32])) -> (s32[], f32[16,32]) {
  %p = (s32[], f32[16,32]) parameter(0)
  %ag = bf16[64,32]{1,0:T(8,128)(2,1)} all-gather(%x), replica_groups=[1,4]<=[4], dimensions={0}
  %rs = f32[16,32]{1,0} fusion(%y), kind=kCustom, calls=%all-reduce-scatter.1
  ROOT %t = (s32[], f32[16,32]) tuple(%i, %rs)
}

%cond (p: (s32[], f32[16,32])) -> pred[] {
  %i = s32[]{:T(128)} get-tuple-element(%p), index=0
  %n = s32[]{:T(128)} constant(3)
  ROOT %lt = pred[]{:T(512)} compare(%i, %n), direction=LT
}

ENTRY %main (a: f32[16,32]) -> f32[] {
  %w = (s32[], f32[16,32]) while(%init), condition=%cond, body=%body
  %ars = (f32[8]{0}, f32[]) all-reduce-start(%v, %s), replica_groups=mesh['data'=2,'fsdp'=2] {'fsdp'}, to_apply=%add
  %ard = (f32[8]{0}, f32[]) all-reduce-done(%ars)
  %cps = (f32[4,4]{1,0}, f32[4,4]{1,0}, u32[], u32[]) collective-permute-start(%q), source_target_pairs={{0,1},{1,0}}
  %cpd = f32[4,4]{1,0} collective-permute-done(%cps)
  ROOT %r = f32[] reduce-scatter(%z), replica_groups={}, dimensions={0}
}
"""  # noqa: E501 - HLO lines as XLA writes them


def test_collectives_are_counted_per_step_with_the_bytes_a_ring_moves():
    counts = collective_counts(HLO, num_devices=4)
    # In the loop body (3 trips, from its condition's bound as the TPU compiler writes no
    # known_trip_count): a bf16 gather of 64x32 over 4 devices sends 3/4 of it.
    assert counts["all-gather"] == dict(
        instructions=1, operands=1, executed=3, exact=True, bytes=3 * 0.75 * 64 * 32 * 2
    )
    # The TPU's reduce-scatter fusion: an all-reduce of the whole array, then a slice.
    assert counts["reduce-scatter"]["executed"] == 3 + 1
    assert counts["reduce-scatter"]["bytes"] == 3 * 0.75 * 64 * 32 * 4 + 0  # + a scalar's 0
    # An async all-reduce counts once, over the 2 devices of "fsdp", twice 1/2 of 8 floats;
    # the scalar operand carries no data worth counting.
    assert counts["all-reduce"] == dict(
        instructions=1, operands=2, executed=1, exact=True, bytes=2 * 0.5 * 8 * 4
    )
    assert counts["collective-permute"]["bytes"] == 4 * 4 * 4  # its result, not the operand
    assert counts["all-to-all"]["instructions"] == 0


def test_a_loop_bound_is_read_from_either_side_of_its_condition():
    flipped = HLO.replace("compare(%i, %n), direction=LT", "compare(%n, %i), direction=GT")
    assert flipped != HLO
    assert collective_counts(flipped, num_devices=4)["all-gather"]["executed"] == 3
    # The TPU compiler's collective matmuls count their loops in unsigned integers.
    unsigned = HLO.replace("s32[]{:T(128)} constant(3)", "u32[]{:T(128)} constant(3)")
    assert unsigned != HLO
    assert (
        collective_counts(unsigned, num_devices=4)["all-gather"]
        == (collective_counts(HLO, num_devices=4)["all-gather"])
    )
    unknown = HLO.replace("direction=LT", "direction=NE")
    assert collective_counts(unknown, num_devices=4)["all-gather"]["exact"] is False


# The TPU's async chain: one all-gather (one channel) copied into its start fusion, a
# continuation that overlaps it with a matmul, and its done fusion.
CHAIN = """\
%start (p0: bf16[4,64]) -> (bf16[4,64], bf16[32,64], u32[]) {
  %p0 = bf16[4,64]{1,0} parameter(0)
  %ag.1 = bf16[32,64]{1,0} all-gather(%p0), channel_id=30, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, frontend_attributes={chain_id="2"}
  ROOT %cc.1 = (bf16[4,64]{1,0}, bf16[32,64]{1,0}, u32[]) custom-call(%ag.1), custom_call_target="AsyncCollectiveStart"
}

%async_collective_fusion.1 (p0: bf16[4,64], p1: bf16[32,64], p2: f32[8,8]) -> (f32[8,8], bf16[32,64]) {
  %p0 = bf16[4,64]{1,0} parameter(0)
  %ag.2 = bf16[32,64]{1,0} all-gather(%p0), channel_id=30, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, frontend_attributes={chain_id="2"}
  %mm = f32[8,8]{1,0} convolution(%p2, %p2), dim_labels=bf_io->bf
  ROOT %t = (f32[8,8]{1,0}, bf16[32,64]{1,0}) tuple(%mm, %ag.2)
}

%done (p0: bf16[4,64], p1: bf16[32,64]) -> bf16[32,64] {
  %p0 = bf16[4,64]{1,0} parameter(0)
  %ag.3 = bf16[32,64]{1,0} all-gather(%p0), channel_id=30, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, frontend_attributes={chain_id="2"}
  ROOT %cc.3 = bf16[32,64]{1,0} custom-call(%p0, %p1, %ag.3), custom_call_target="AsyncCollectiveDone"
}

ENTRY %main (k: bf16[4,64], w: f32[8,8]) -> bf16[32,64] {
  %s = (bf16[4,64]{1,0}, bf16[32,64]{1,0}, u32[]) fusion(%k), kind=kCustom, calls=%start
  %c = (f32[8,8]{1,0}, bf16[32,64]{1,0}) fusion(%k, %g, %w), kind=kCustom, calls=%async_collective_fusion.1
  ROOT %d = bf16[32,64]{1,0} fusion(%k, %g), kind=kCustom, calls=%done
}
"""  # noqa: E501 - HLO lines as XLA writes them


def test_an_async_chain_of_fusions_counts_its_collective_once():
    gathered = collective_counts(CHAIN, num_devices=8)["all-gather"]
    assert gathered == dict(
        instructions=1, operands=1, executed=1, exact=True, bytes=7 / 8 * 32 * 64 * 2
    )


def _run(argv, capsys):
    status = main(["compile", *argv])
    out, err = capsys.readouterr()
    return status, out.strip().splitlines(), err.strip().splitlines()


def test_an_unknown_topology_exits_2_with_one_line(capsys):
    status, out, err = _run(["--topology", "v5x-8"], capsys)
    assert status == 2 and not out
    assert len(err) == 1 and err[0].startswith("error: unknown --topology 'v5x-8'")


def test_a_mesh_that_does_not_match_the_topology_exits_2(capsys):
    status, _, err = _run(["--topology", "cpu-4", "mesh.data=8", *TINY], capsys)
    assert status == 2
    assert err == [
        "error: mesh data=8 fsdp=1 tensor=1 needs 8 devices, but there are 4; set "
        "one axis to -1 to take the remaining devices"
    ]


def test_without_libtpu_it_says_what_to_install(capsys, monkeypatch):
    monkeypatch.setattr(topology, "_libtpu_installed", lambda: False)
    status, _, err = _run(["--topology", "v5e-4", *TINY], capsys)
    assert status == 2 and len(err) == 1
    assert 'pip install "jax[tpu]==' in err[0] and '.[tpu]"' in err[0]


def test_h100_without_jax_plugins_at_all_exits_2_saying_what_to_install(capsys, monkeypatch):
    """Without any PJRT plugin there is no ``jax_plugins`` package, and ``find_spec`` of a module
    inside it raises instead of returning None: the same line, exit 2 (not 1, "does not fit")."""
    monkeypatch.setitem(sys.modules, "jax_plugins", None)  # import jax_plugins fails
    monkeypatch.delitem(sys.modules, "jax_plugins.xla_cuda12", raising=False)
    status, out, err = _run(["--topology", "h100-8", *TINY], capsys)
    assert (status, out) == (2, [])
    assert len(err) == 1 and "jax-cuda12-plugin==" in err[0] and ".[gpu-compile]" in err[0], err


def test_cpu_devices_of_this_process(capsys):
    status, out, _ = _run(["--topology", "cpu-4", "mesh.data=2", "mesh.fsdp=2", *TINY], capsys)
    summary = json.loads(out[-1])
    assert status == 0 and set(summary) == SUMMARY_KEYS
    assert summary["topology"] == "cpu-4" and summary["chips"] == 4
    assert summary["fits"] is None and summary["estimated_mfu"] is None  # no chip figures
    assert summary["flops_per_step"] > 0 and summary["collectives"]["all-gather"] > 0
    assert summary["attention"] == "xla"
    assert out[0] == "train step for cpu-4 (4 CPU devices), mesh data 2 x fsdp 2 x tensor 1"


def test_flops_per_step_count_every_executed_layer_scanned_or_not(capsys):
    """XLA counts a scanned loop's body once: its count falls with model.scan_layers=true, while
    flops_per_step, per executed step, stays the model's count."""
    summaries = {}
    for scan in ("false", "true"):
        argv = ["--topology", "cpu-1", f"model.scan_layers={scan}", *TINY]
        status, out, _ = _run(argv, capsys)
        assert status == 0
        summaries[scan] = json.loads(out[-1])
    unrolled, scanned = summaries["false"], summaries["true"]
    assert unrolled["flops_per_step"] == scanned["flops_per_step"] > 0
    xla_unrolled, xla_scanned = unrolled["xla_flops_per_program"], scanned["xla_flops_per_program"]
    assert xla_scanned < 0.75 * xla_unrolled  # one of gpt2-tiny's 2 layers counted
    assert unrolled["flops_per_step"] == pytest.approx(xla_unrolled, rel=0.15)


@pytest.mark.slow  # two compiles of the train step, ~25 s each on a loaded 2-core CPU
def test_a_chunked_loss_needs_less_temporary_memory_per_device(capsys):
    """The float32 logits of 4 rows x 64 positions x 16384 words per device (16 MiB, their
    gradient as much again) become those of 16 positions at a time."""
    argv = ["--topology", "cpu-2", "mesh.data=2", "train.batch_size=8", "data.seq_len=64"]
    argv.append("model.vocab_size=16384")
    temp = {}
    for chunk in ("null", "16"):
        status, out, _ = _run([*argv, f"train.loss_chunk={chunk}"], capsys)
        assert status == 0, out
        temp[chunk] = json.loads(out[-1])["per_chip_bytes"]["temp"]
    assert temp["null"] - temp["16"] > 8 * 2**20, temp  # half the whole batch's logits or more


def test_decode_compiles_the_generation_loop(capsys):
    argv = ["--topology", "cpu-2", "--decode", "--max_new_tokens", "4", "mesh.data=2", *TINY]
    status, out, _ = _run(argv, capsys)
    summary = json.loads(out[-1])
    assert status == 0 and out[0].startswith("generation for cpu-2")
    assert summary["per_chip_bytes"]["optimizer"] == 0 < summary["per_chip_bytes"]["params"]
    status, _, err = _run([*argv, "--config", str(CONFIGS / "bert_tiny.yaml")], capsys)
    assert status == 2 and err == [
        "error: --decode needs a decoder or encoder-decoder model; model.kind is encoder"
    ]


@pytest.mark.slow
def test_cpu_n_sets_the_device_count_before_jax_starts(tmp_path):
    """More devices than this test session's 8: the command sets the count itself."""
    code = "import sys; from flaxformer_lite.cli import main; sys.exit(main(sys.argv[1:]))"
    argv = ["compile", "--topology", "cpu-16", "mesh.fsdp=-1", "mesh.data=1"]
    done = subprocess.run(
        [sys.executable, "-c", code, *argv, "train.batch_size=16", "data.seq_len=16"],
        env=subprocess_env(8),
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["chips"] == 16 and summary["collectives"]["all-gather"] > 0
