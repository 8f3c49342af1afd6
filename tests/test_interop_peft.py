"""A Hugging Face PEFT LoRA adapter merged into our model of its base (interop.merge_peft): the
logits of ``peft.PeftModel`` on the Hugging Face base, for GPT-2 (Conv1D, a fused q/k/v),
Llama (grouped keys and values) and BERT; adapters it cannot read, or of another base, refused
naming the key, the model unchanged."""

import dataclasses
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from flaxformer_lite.interop import load_hf, save_hf
from flaxformer_lite.interop.peft import merge_peft, save_peft
from flaxformer_lite.models import ModelConfig, build_model
from flaxformer_lite.nn.lora import add_adapters

pytestmark = pytest.mark.fast_compile  # XLA's backend optimizations off: conftest.py

TARGETS = {
    "gpt2": ["c_attn", "c_proj", "c_fc"],
    "llama": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "bert": ["query", "key", "value", "dense"],
}
IDS = np.random.default_rng(0).integers(0, 50, (2, 7))


def base_model(transformers, torch, name):
    torch.manual_seed(1)
    if name == "gpt2":
        config = transformers.GPT2Config(
            n_embd=16, n_head=2, n_layer=2, n_positions=32, vocab_size=50
        )
        return transformers.GPT2LMHeadModel(config).eval()
    if name == "llama":
        config = transformers.LlamaConfig(
            hidden_size=16,
            intermediate_size=24,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_hidden_layers=2,
            vocab_size=300,
        )
        return transformers.LlamaForCausalLM(config).eval()
    config = transformers.BertConfig(
        hidden_size=16,
        intermediate_size=24,
        num_attention_heads=2,
        num_hidden_layers=2,
        vocab_size=300,
        max_position_embeddings=32,
    )
    return transformers.BertForMaskedLM(config).eval()


@pytest.fixture(scope="module")
def adapters(hf, tmp_path_factory):
    """Each family's base and an adapter of rank 4 (alpha 8, every pair random), and PEFT's
    logits of the two."""
    peft = pytest.importorskip("peft", reason="needs the dev extra's peft")
    root, made = tmp_path_factory.mktemp("peft"), {}
    for name, targets in TARGETS.items():
        base_model(hf.transformers, hf.torch, name).save_pretrained(root / f"{name}_base")
        config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0)
        model = peft.get_peft_model(base_model(hf.transformers, hf.torch, name), config)
        for parameter_name, parameter in model.named_parameters():
            if "lora_" in parameter_name:
                hf.torch.nn.init.normal_(parameter, std=0.2)
        model.eval().save_pretrained(root / f"{name}_adapter")
        with hf.torch.no_grad():
            logits = model(input_ids=hf.torch.tensor(IDS)).logits.numpy()
        made[name] = (root / f"{name}_base", root / f"{name}_adapter", logits)
    return made


@pytest.mark.parametrize("name", list(TARGETS))
def test_a_merged_adapter_gives_peft_logits(adapters, name):
    base, adapter, expected = adapters[name]
    model, cfg = load_hf(base)
    before = np.asarray(model(jnp.asarray(IDS)))
    assert np.abs(before - expected).max() > 1e-2  # the adapter changes the function
    changed = merge_peft(model, cfg, adapter)
    layers = cfg.num_decoder_layers if cfg.kind == "decoder" else cfg.num_encoder_layers
    per_layer = {"gpt2": 4, "llama": 7, "bert": 6}[name]
    assert changed == per_layer * layers + (name == "bert")  # BERT's head transform: "dense"
    np.testing.assert_allclose(np.asarray(model(jnp.asarray(IDS))), expected, atol=1e-4)


def test_adapters_it_cannot_read_are_refused_and_the_model_kept(adapters, tmp_path):
    base, adapter, _ = adapters["gpt2"]
    model, cfg = load_hf(base)
    before = np.asarray(model(jnp.asarray(IDS)))

    def edited(name, settings=None, drop=None):
        copy = tmp_path / name
        shutil.copytree(adapter, copy)
        if settings:
            config = json.loads((copy / "adapter_config.json").read_text())
            (copy / "adapter_config.json").write_text(json.dumps(config | settings))
        if drop:
            from safetensors.numpy import load_file, save_file

            tensors = load_file(copy / "adapter_model.safetensors")
            save_file(
                {k: v for k, v in tensors.items() if drop not in k},
                copy / "adapter_model.safetensors",
            )
        return copy

    cases = [
        (
            adapters["llama"][1],
            "base_model.model.model.layers.0.mlp.down_proj: the base (decoder) has no projection",
        ),
        (edited("dora", {"use_dora": True}), "use_dora=True is not read here"),
        (
            edited("saved", {"modules_to_save": ["lm_head"]}),
            "modules_to_save=['lm_head'] is not read here",
        ),
        (
            edited("half", drop="h.1.mlp.c_fc.lora_B"),
            "base_model.model.transformer.h.1.mlp.c_fc: lora_B is missing",
        ),
        (tmp_path / "nowhere", "no adapter_config.json"),
    ]
    for directory, message in cases:
        with pytest.raises((ValueError, FileNotFoundError)) as refused:
            merge_peft(model, cfg, directory)
        assert message in str(refused.value), (directory, str(refused.value))
    # An adapter of another size: the shape named.
    other = base_model_of_width(tmp_path, adapters)
    with pytest.raises(ValueError, match=r"lora_A|has shape"):
        merge_peft(*other, adapter)
    np.testing.assert_array_equal(np.asarray(model(jnp.asarray(IDS))), before)


def base_model_of_width(tmp_path, adapters):
    """Our GPT-2 of the adapter's family at another width (n_embd 32)."""
    import transformers

    config = transformers.GPT2Config(n_embd=32, n_head=2, n_layer=2, n_positions=32, vocab_size=300)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path / "wide")
    return load_hf(tmp_path / "wide")


def test_generate_and_evaluate_take_an_adapter_of_their_hf_dir(adapters, tmp_path, capsys):
    """``--adapter`` on the commands: the merged model's greedy ids and task scores; refused
    beside a run directory."""
    from flaxformer_lite.cli import main
    from flaxformer_lite.train.trained_run import load_decoder

    base, adapter, _ = adapters["llama"]
    _llama_tokenizer(base)
    model, tokenizer = load_decoder(hf_dir=base, adapter=adapter)
    merged, _ = load_hf(base)
    merge_peft(merged, load_hf(base)[1], adapter)
    np.testing.assert_array_equal(
        np.asarray(model(jnp.asarray(IDS))), np.asarray(merged(jnp.asarray(IDS)))
    )
    argv = [
        "--hf-dir",
        str(base),
        "--adapter",
        str(adapter),
        "--prompt",
        "ab",
        "--max-new-tokens",
        "3",
    ]
    assert main(["generate", *argv]) == 0
    task = tmp_path / "t.jsonl"
    task.write_text(json.dumps({"context": "a", "choices": ["b", "c"], "answer": 0}) + "\n")
    tasks = [f"evals.tasks.t.path={task}", "evals.tasks.t.format=choice"]
    assert main(["evaluate", "--hf-dir", str(base), "--adapter", str(adapter), *tasks]) == 0
    capsys.readouterr()
    run_argv = ["--run-dir", str(tmp_path), "--adapter", str(adapter), "--prompt", "x"]
    assert main(["generate", *run_argv]) == 2
    assert "--adapter applies to --hf-dir" in capsys.readouterr().err


def _llama_tokenizer(base):
    """The tiny Llama base with a tokenizer of its own (a BPE of hf_checkpoints)."""
    import hf_checkpoints
    import transformers

    if (base / "tokenizer.json").exists():
        return
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=hf_checkpoints.bpe_tokenizer(vocab_size=300),
        bos_token=hf_checkpoints.EOT,
        eos_token=hf_checkpoints.EOT,
        unk_token=hf_checkpoints.EOT,
    )
    tokenizer.save_pretrained(base)


@pytest.mark.parametrize("name", list(TARGETS))
def test_our_adapters_written_as_peft_give_our_logits_and_read_back_merged(
    adapters, hf, tmp_path, name
):
    """``save_peft`` of adapters on every attention and MLP projection of ``load_hf``'s model:
    ``PeftModel`` on the base computes our logits, and ``merge_peft`` of the written adapter
    into a fresh base, the same."""
    peft = pytest.importorskip("peft", reason="needs the dev extra's peft")
    base, _, _ = adapters[name]
    model, cfg = load_hf(base)
    rngs = nnx.Rngs(params=4, dropout=5)
    add_adapters(model, rank=3, alpha=5, targets=["attention", "mlp"], rngs=rngs)
    drawn = jax.tree.map(lambda x: 0.3 * np.random.default_rng(x.size).normal(size=x.shape),
                         nnx.state(model, nnx.LoRAParam))  # fmt: skip
    nnx.update(model, drawn)
    model.eval()
    ours = np.asarray(model(jnp.asarray(IDS)))
    modules = save_peft(model, cfg, tmp_path / "adapter", base=str(base))
    assert len(modules) == {"gpt2": 4, "llama": 7, "bert": 6}[name] * 2
    auto = "AutoModelForMaskedLM" if name == "bert" else "AutoModelForCausalLM"
    hf_base = getattr(hf.transformers, auto).from_pretrained(base)
    adapted = peft.PeftModel.from_pretrained(hf_base, tmp_path / "adapter").eval()
    with hf.torch.no_grad():
        theirs = adapted(input_ids=hf.torch.tensor(IDS)).logits.numpy()
    np.testing.assert_allclose(theirs, ours, atol=1e-4)
    fresh, _ = load_hf(base)
    merge_peft(fresh, cfg, tmp_path / "adapter")
    np.testing.assert_allclose(np.asarray(fresh(jnp.asarray(IDS))), ours, atol=1e-5)


def test_a_scanned_stack_s_adapters_are_written_layer_by_layer(hf, tmp_path):
    peft = pytest.importorskip("peft", reason="needs the dev extra's peft")
    cfg = dataclasses.replace(ModelConfig.from_preset("gpt2-tiny", vocab_size=50), scan_layers=True)
    rngs = nnx.Rngs(params=0, dropout=1)
    model = build_model(cfg, rngs=rngs)
    save_hf(model, cfg, tmp_path / "base")
    add_adapters(model, rank=2, alpha=2, targets=["qkv", "wo"], rngs=rngs)
    nnx.update(model, jax.tree.map(lambda x: x + 0.1, nnx.state(model, nnx.LoRAParam)))
    model.eval()
    save_peft(model, cfg, tmp_path / "adapter")
    settings = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert settings["target_modules"] == [
        "transformer.h.0.mlp.c_proj", "transformer.h.0.attn.c_attn",
        "transformer.h.1.mlp.c_proj", "transformer.h.1.attn.c_attn",
    ]  # fmt: skip
    assert settings["fan_in_fan_out"] and settings["task_type"] == "CAUSAL_LM"
    hf_base = hf.transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "base")
    adapted = peft.PeftModel.from_pretrained(hf_base, tmp_path / "adapter").eval()
    with hf.torch.no_grad():
        theirs = adapted(input_ids=hf.torch.tensor(IDS)).logits.numpy()
    np.testing.assert_allclose(theirs, np.asarray(model(jnp.asarray(IDS))), atol=1e-4)


def test_an_rslora_adapter_of_any_rank_round_trips_into_a_run_s_adapters(tmp_path):
    """save_peft writes rsLoRA's scale as a plain alpha (alpha * sqrt(r)), which reads back within
    the float's last bit; load_peft_adapters takes it (rank 5: not exactly)."""
    from flaxformer_lite.interop.peft import load_peft_adapters
    from flaxformer_lite.nn.lora import lora_scale

    cfg = ModelConfig.from_preset("gpt2-tiny", vocab_size=50)
    rngs = nnx.Rngs(params=0, dropout=1)
    model = build_model(cfg, rngs=rngs)
    add_adapters(model, rank=5, alpha=16, targets=["mlp"], rslora=True, rngs=rngs)
    nnx.update(model, jax.tree.map(lambda x: x + 0.1, nnx.state(model, nnx.LoRAParam)))
    save_peft(model, cfg, tmp_path / "adapter")
    fresh = build_model(cfg, rngs=nnx.Rngs(params=2, dropout=3))
    add_adapters(fresh, rank=5, alpha=16, targets=["mlp"], rslora=True, rngs=nnx.Rngs(4))
    state = nnx.split((fresh, fresh))[1]
    state = load_peft_adapters(state, cfg, tmp_path / "adapter", lora_scale(16, 5, True))
    jax.tree.map(
        np.testing.assert_allclose,
        nnx.to_pure_dict(nnx.filter_state(state[0], nnx.LoRAParam)),
        nnx.to_pure_dict(nnx.state(model, nnx.LoRAParam)),
    )
