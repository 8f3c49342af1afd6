"""LoRA runs (``lora.rank``) end to end, on an imported GPT-2 (``init_from``, a tiny random one
``tests/hf_checkpoints.py`` writes): the adapters alone train (the base bit for bit as imported,
the checkpoints and the optimizer hold the adapters and name the base); the merged export gives
our logits through ``transformers``, the PEFT adapter through ``peft.PeftModel`` on the original
base (and PEFT counts the trainable parameters we count), and a PEFT adapter read into a run
round-trips; SIGTERM then the same command equals an unbroken run; a base that changed under a
run is refused; a sharded base trains as a replicated one; a sweep over rank and learning rate
trains one program per rank whose members equal their own runs; bad settings exit 2 with one
line and nothing written."""

import json
import os
import shutil
import signal

import hf_checkpoints
import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from run_states import checkpointed_state
from tiny_runs import TINY

from flaxformer_lite.cli import main
from flaxformer_lite.interop import load_hf
from flaxformer_lite.nn.lora import BASE
from flaxformer_lite.train import lanes
from flaxformer_lite.train.config import load_config
from flaxformer_lite.train.export import export_run
from flaxformer_lite.train.loop import Interrupted, run
from flaxformer_lite.train.metrics import read_metrics
from flaxformer_lite.train.sweep import sweep
from flaxformer_lite.train.trained_run import load_run

pytestmark = pytest.mark.fast_compile  # XLA's backend optimizations off: conftest.py

STEPS = 6
IDS = np.random.default_rng(0).integers(0, 250, (2, 11))


def settings(root, base, name="run"):
    return [
        f"init_from={base}",
        f"run_dir={root / name}",
        "data.source=text",
        f"data.path={root / 'corpus.txt'}",
        "data.seq_len=16",
        "train.batch_size=8",
        f"train.steps={STEPS}",
        "train.log_every=1",
        f"train.eval_every={STEPS}",
        "train.eval_batches=1",
        "train.decode_examples=0",
        "checkpoint.every=2",
        "optimizer.lr=1e-2",
        "optimizer.warmup_steps=0",
        "optimizer.schedule=constant",
        "optimizer.weight_decay=0.1",
        "lora.rank=4",
        "lora.alpha=8",
        "lora.dropout=0.1",
    ]


def losses_of(run_dir):
    return {r["step"]: r["loss"] for r in read_metrics(run_dir, log=None) if "loss" in r}


@pytest.fixture(scope="module")
def lora_run(hf, tmp_path_factory):
    """A GPT-2 base and a 6-step LoRA run on it (rank 4 on attention and MLP, dropout 0.1)."""
    root = tmp_path_factory.mktemp("lora")
    hf_checkpoints.gpt2_dir(hf.transformers, hf.torch, root / "base")
    (root / "corpus.txt").write_text("\n".join(hf_checkpoints.CORPUS * 4) + "\n")
    logs = []
    run(load_config(None, settings(root, root / "base")), progress=False, log=logs.append)
    return root, logs


def test_the_adapters_alone_train_and_the_checkpoints_hold_them(lora_run):
    root, logs = lora_run
    # 2 layers of d_model 32: qkv 32 -> 96, out 32 -> 32, wi 32 -> 128, wo 128 -> 32.
    expected = 2 * 4 * ((32 + 96) + (32 + 32) + (32 + 128) + (128 + 32))
    line = next(line for line in logs if line.startswith("trainable:"))
    assert f"the LoRA adapters, {expected:,} of " in line, line
    loaded = load_run(root / "run")
    adapters = nnx.state(loaded.model, nnx.LoRAParam)
    assert sum(x.size for x in jax.tree.leaves(adapters)) == expected
    assert all(np.abs(np.asarray(x)).max() > 0 for x in jax.tree.leaves(adapters))  # trained
    imported, _ = load_hf(root / "base")
    jax.tree.map(
        np.testing.assert_array_equal,
        nnx.to_pure_dict(nnx.state(loaded.model, BASE)),
        nnx.to_pure_dict(nnx.state(imported, nnx.Param)),
    )
    step_dir = root / "run" / "checkpoints" / str(STEPS)
    metadata = ocp.StandardCheckpointHandler().metadata(step_dir / "state")
    names = ["/".join(map(str, k)) for k in _paths(metadata)]
    params = [n for n in names if n.startswith("0/") and "rngs" not in n]
    assert params and all("/lora/" in n for n in params), params  # no base parameter
    sizes = sum(np.prod(leaf.shape) for leaf in jax.tree.leaves(metadata))
    assert sizes < 4 * expected  # adapters, 2 moments, RNG state: never the 37k of the base
    base = json.loads((step_dir / "fingerprints" / "metadata").read_text())["base"]
    assert base["source"] == f"init_from={root / 'base'}" and len(base["arrays"]) == 28
    assert losses_of(root / "run")[STEPS] < losses_of(root / "run")[1]


def _paths(tree):
    return [
        tuple(getattr(k, "key", getattr(k, "name", k)) for k in path)
        for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]
    ]


def test_the_merged_export_and_the_peft_adapter_give_our_logits(lora_run, hf, tmp_path):
    peft = pytest.importorskip("peft", reason="needs the dev extra's peft")
    root, _ = lora_run
    ours = np.asarray(load_run(root / "run").model(IDS))
    merged = export_run(root / "run", tmp_path / "merged")
    model = hf.transformers.AutoModelForCausalLM.from_pretrained(merged.path)
    with hf.torch.no_grad():
        theirs = model(hf.torch.tensor(IDS)).logits.numpy()
    np.testing.assert_allclose(theirs, ours, atol=2e-5, rtol=1e-5)
    assert (
        main(["export", "--run-dir", str(root / "run"), "--out", str(tmp_path / "a"), "--peft"])
        == 0
    )
    assert sorted(os.listdir(tmp_path / "a")) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    base = hf.transformers.AutoModelForCausalLM.from_pretrained(root / "base")
    adapted = peft.PeftModel.from_pretrained(base, tmp_path / "a", is_trainable=True)
    adapted.eval()
    with hf.torch.no_grad():
        theirs = adapted(input_ids=hf.torch.tensor(IDS)).logits.numpy()
    np.testing.assert_allclose(theirs, ours, atol=2e-5, rtol=1e-5)
    trainable, total = adapted.get_nb_trainable_parameters()
    loaded = load_run(root / "run").model
    assert trainable == sum(x.size for x in jax.tree.leaves(nnx.state(loaded, nnx.LoRAParam)))
    assert total == sum(x.size for x in jax.tree.leaves(nnx.state(loaded, nnx.Param)))
    # ... and read back into a run (lora.adapter), its adapters are those exported.
    again = [*settings(root, root / "base", "again"), f"lora.adapter={tmp_path / 'a'}"]
    again += ["train.steps=1", "optimizer.lr=0"]
    run(load_config(None, [*again, f"run_dir={tmp_path / 'again'}"]), progress=False, log=print)
    back = nnx.state(load_run(tmp_path / "again").model, nnx.LoRAParam)
    jax.tree.map(np.testing.assert_array_equal, back, nnx.state(loaded, nnx.LoRAParam))


def test_sigterm_then_the_same_command_equals_the_unbroken_run(lora_run, monkeypatch):
    root, _ = lora_run
    cfg = load_config(None, settings(root, root / "base", "stopped"))
    step_of, calls = lanes.InTurn.step, []

    def stopping_at_step_3(self, *args):
        calls.append(1)
        if len(calls) == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return step_of(self, *args)

    monkeypatch.setattr(lanes.InTurn, "step", stopping_at_step_3)
    with pytest.raises(Interrupted):
        run(cfg, progress=False, log=lambda _: None)
    monkeypatch.undo()
    lines = []
    run(cfg, progress=False, log=lines.append)
    assert any(line.startswith("resumed from step 3 of ") for line in lines), lines
    assert losses_of(root / "stopped") == losses_of(root / "run")
    jax.tree.map(
        np.testing.assert_array_equal,
        checkpointed_state(root / "stopped", STEPS),
        checkpointed_state(root / "run", STEPS),
    )


def test_a_base_that_changed_under_the_adapters_is_refused(lora_run, hf, tmp_path, capsys):
    root, _ = lora_run
    shutil.copytree(root / "base", tmp_path / "base")
    shutil.copy(root / "corpus.txt", tmp_path / "corpus.txt")
    overrides = [*settings(tmp_path, tmp_path / "base"), "train.steps=2"]
    assert main(["train", "--no-progress", *overrides]) == 0
    model = hf.transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    hf_checkpoints.randomize(hf.torch, model, seed=5).save_pretrained(tmp_path / "base")
    before = sorted(p.name for p in (tmp_path / "run").rglob("*"))
    capsys.readouterr()
    assert main(["train", "--no-progress", *overrides[:-1], "train.steps=4"]) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and "holds adapters of another base" in error[0], error
    assert f"trained on init_from={tmp_path / 'base'}" in error[0]
    assert sorted(p.name for p in (tmp_path / "run").rglob("*")) == before


def test_a_sharded_base_trains_its_adapters_as_a_replicated_one(tmp_path):
    """data 8 (every parameter whole on each device) vs data 2 x fsdp 2 x tensor 2 (the base and
    the adapters split by their logical axes): the same losses."""
    common = [*TINY, "train.steps=4", "lora.rank=4", "optimizer.schedule=constant"]
    logged = {}
    meshes = {
        "replicated": ["mesh.data=8"],
        "sharded": ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"],
    }
    for name, mesh in meshes.items():
        cfg = load_config(None, [*common, *mesh, f"run_dir={tmp_path / name}"])
        run(cfg, progress=False, log=lambda _: None)
        logged[name] = losses_of(tmp_path / name)
    np.testing.assert_allclose(
        [logged["sharded"][s] for s in sorted(logged["replicated"])],
        [logged["replicated"][s] for s in sorted(logged["replicated"])],
        rtol=1e-5,
    )


def test_a_sweep_over_rank_and_rate_is_one_program_per_rank(tmp_path):
    common = [*TINY, "train.steps=3", "lora.rank=2", "optimizer.schedule=constant", "seed=1"]
    vary = {"lora.rank": ["2", "4"], "optimizer.lr": ["1e-3", "1e-2"]}
    lines = []
    cfg = load_config(None, [*common, f"run_dir={tmp_path / 's'}"])
    sweep(cfg, vary, vmap=False, log=lines.append)
    said = "sweep: 4 members, 2 compiled programs (2 + 2 members, split by lora.rank)"
    assert lines[0] == said, lines
    member = tmp_path / "s" / "rank=4,lr=1e-2"
    assert (
        main(["train", "--config", str(member / "config.yaml"), f"run_dir={tmp_path / 'solo'}"])
        == 0
    )
    assert losses_of(tmp_path / "solo") == losses_of(member)
    # A seeded base is no one else's: its adapters alone are not exported as a PEFT adapter.
    peft = ["export", "--run-dir", str(tmp_path / "solo"), "--out", str(tmp_path / "a"), "--peft"]
    assert main(peft) == 2 and not (tmp_path / "a").exists()


@pytest.mark.parametrize(
    "overrides, says",
    [
        (["lora.rank=0"], "lora.rank must be a positive int, got 0"),
        (["lora.rank=65"], "lora.rank=65 is larger than the matrix decoder.layers.layers.0."),
        (["lora.rank=2", "lora.targets=[q_proj]"], "'q_proj' names no projection of this model"),
        (["lora.rank=2", "optimizer.name=muon"], "lora.rank with optimizer.name=muon"),
        (["lora.rank=2", "lora.adapter=/nowhere"], "lora.adapter=/nowhere needs init_from"),
    ],
)
def test_bad_lora_settings_exit_2_with_one_line_and_write_nothing(
    tmp_path, capsys, overrides, says
):
    assert main(["train", *TINY, f"run_dir={tmp_path / 'run'}", *overrides]) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and says in error[0], error
    assert not (tmp_path / "run").exists()


def test_a_peft_adapter_of_another_base_is_refused_before_anything_is_written(
    lora_run, hf, tmp_path, capsys
):
    peft = pytest.importorskip("peft", reason="needs the dev extra's peft")
    root, _ = lora_run
    wide = hf.transformers.GPT2Config(
        n_embd=16, n_head=2, n_layer=2, n_positions=64, vocab_size=300
    )
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"])
    other = peft.get_peft_model(hf.transformers.GPT2LMHeadModel(wide), config)
    other.save_pretrained(tmp_path / "adapter")
    overrides = [*settings(root, root / "base", "x"), f"lora.adapter={tmp_path / 'adapter'}"]
    overrides.append(f"run_dir={tmp_path / 'run'}")
    assert main(["train", *overrides]) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and "has shape" in error[0] and "c_attn" in error[0], error
    assert not (tmp_path / "run").exists()


def test_generate_continues_with_the_adapters(lora_run, capsys):
    root, _ = lora_run
    assert (
        main(
            ["generate", "--run-dir", str(root / "run"), "--prompt", "the", "--max-new-tokens", "4"]
        )
        == 0
    )
    assert capsys.readouterr().out.strip()


def test_the_recipe_fine_tunes_an_exported_base_of_ours(tmp_path, monkeypatch):
    """The three commands of configs/lora_shakespeare.yaml, cut to a few steps of a small base."""
    monkeypatch.chdir(tmp_path)
    small = ["model.num_decoder_layers=1", "model.d_model=32", "model.d_ff=64", "model.num_heads=2"]
    short = ["train.steps=2", "train.eval_every=2", "train.eval_batches=1", "train.batch_size=8"]
    base = ["--config", "shakespeare_char", "run_dir=runs/shakespeare_base", *small, *short]
    assert main(["train", "--no-progress", *base]) == 0
    export = ["export", "--run-dir", "runs/shakespeare_base", "--out", "exports/shakespeare_base"]
    assert main(export) == 0
    assert main(["train", "--no-progress", "--config", "lora_shakespeare", *short]) == 0
    cfg = load_config(tmp_path / "runs" / "lora_shakespeare" / "config.yaml")
    assert (cfg.init_from, cfg.lora.rank, cfg.model.d_model) == ("exports/shakespeare_base", 8, 32)
    assert losses_of(tmp_path / "runs" / "lora_shakespeare")
