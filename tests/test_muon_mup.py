"""Muon against an independent float64 Newton-Schulz, and muP's multipliers against the table in
docs/reference.md, measured on the models: each parameter's initial scale, its learning rate,
the logits' and the attention's multipliers; muP at its base width is the standard."""

import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from flaxformer_lite.models import ModelConfig, build_model
from flaxformer_lite.models.width import attention_scale, growing_axes
from flaxformer_lite.nn.attention import MultiHeadAttention
from flaxformer_lite.nn.parametrization import MUP, parameter_roles
from flaxformer_lite.train.optim import make_optimizer
from flaxformer_lite.train.sections import OptimizerConfig

pytestmark = pytest.mark.fast_compile  # XLA's backend optimizations off: conftest.py

REFERENCE = pathlib.Path(__file__).resolve().parents[1] / "docs" / "reference.md"
NS_COEFFS = (3.4445, -4.7750, 2.0315)  # Keller Jordan's quintic, optax's default


def newton_schulz64(x: np.ndarray, steps: int = 5) -> np.ndarray:
    """Muon's orthogonalization of one ``[in, out]`` matrix in float64: normalized by its
    Frobenius norm, then ``X <- a X + (b A + c A A) X`` with ``A = X X^T`` on the wide side."""
    a, b, c = NS_COEFFS
    x = np.asarray(x, np.float64) / (np.linalg.norm(x) + 1e-8)
    tall = x.shape[0] > x.shape[1]
    x = x.T if tall else x
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


def flat(tree) -> dict[str, np.ndarray]:
    return {
        "/".join(map(str, path)): np.asarray(v, np.float64)
        for path, v in nnx.to_flat_state(nnx.State(tree) if isinstance(tree, dict) else tree)
    }


def random_grads(params, seed):
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), p.dtype), params)


def test_muon_updates_each_projection_by_a_float64_newton_schulz_of_its_momentum():
    """Two steps of a scanned GPT-2 (fused q/k/v ``[L, D, 3, H, Dh]``): every hidden matrix
    (each layer's q, k, v, output and MLP kernels apart) moves by ``-lr * ratio * (rms *
    sqrt(max(in, out)) * NS(Nesterov momentum) + wd * W)``; the tables, norms and biases by
    AdamW's formula, undecayed."""
    lr, ratio, rms, wd, beta, b1, b2, eps = 0.1, 0.5, 0.2, 0.1, 0.95, 0.9, 0.99, 1e-8
    model_cfg = ModelConfig.from_preset("gpt2-tiny", scan_layers=True, vocab_size=64)
    opt = OptimizerConfig(
        name="muon",
        lr=lr,
        schedule="constant",
        warmup_steps=0,
        weight_decay=wd,
        clip_norm=None,
        muon_lr_ratio=ratio,
        muon_rms=rms,
        b2=b2,
    )
    model = build_model(model_cfg, rngs=nnx.Rngs(0))
    tx, _ = make_optimizer(opt, model_cfg, total_steps=10)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    grads = [random_grads(nnx.state(model, nnx.Param), seed) for seed in (1, 2)]
    params, updates = [], []
    for g in grads:
        params.append(flat(jax.tree.map(np.asarray, nnx.state(model, nnx.Param))))
        updates.append(flat(optimizer.update(model, g)))
    g1, g2 = flat(grads[0]), flat(grads[1])

    L, D, H, Dh = 2, model_cfg.d_model, model_cfg.num_heads, model_cfg.head_dim
    matrices = {  # path -> the [in, out] matrices of one layer's leaf
        "decoder/layers/layers/self_attention/qkv/kernel": lambda x: [
            x[:, j].reshape(D, H * Dh) for j in range(3)
        ],
        "decoder/layers/layers/self_attention/out/kernel": lambda x: [x.reshape(H * Dh, D)],
        "decoder/layers/layers/mlp/wi/kernel": lambda x: [x],
        "decoder/layers/layers/mlp/wo/kernel": lambda x: [x],
    }
    assert {k for k in updates[1] if k.endswith("kernel")} == set(matrices)
    for path, pieces in matrices.items():
        momentum = (1 - beta) * g1[path]
        momentum = beta * momentum + (1 - beta) * g2[path]
        nesterov = beta * momentum / (1 - beta**3) + (1 - beta) * g2[path] / (1 - beta**2)
        for layer in range(L):
            got, weights = pieces(updates[1][path][layer]), pieces(params[1][path][layer])
            for m, u, w in zip(pieces(nesterov[layer]), got, weights, strict=True):
                scale = rms * np.sqrt(max(m.shape))
                expected = -lr * ratio * (scale * newton_schulz64(m) + wd * w)
                np.testing.assert_allclose(u, expected, atol=2e-4 * np.abs(expected).max())

    others = [k for k in updates[1] if not k.endswith("kernel")]
    assert "embed/tokens/embedding" in others and "decoder/final_norm/scale" in others
    for path in others:
        m = (1 - b1) * ((1 - b1) * g1[path] * b1 / (1 - b1) + g2[path])
        v = (1 - b2) * (b2 * g1[path] ** 2 + g2[path] ** 2)
        adam = (m / (1 - b1**2)) / (np.sqrt(v / (1 - b2**2)) + eps)
        np.testing.assert_allclose(updates[1][path], -lr * adam, rtol=2e-5, atol=1e-8)


def reference_table() -> dict[str, dict[str, float | None]]:
    """docs/reference.md's muP table: ``{role: {column: power of m, or None for "-"}}``."""
    lines = [ln for ln in REFERENCE.read_text().splitlines() if ln.startswith("| ")]
    header = next(ln for ln in lines if ln.startswith("| role |"))
    columns = [c.strip() for c in header.strip("|").split("|")]

    def power(cell: str) -> float | None:
        cell = cell.strip()
        if cell == "-":
            return None
        if cell == "1":
            return 0.0
        num, _, den = re.fullmatch(r"m\^(-?\d+(?:/\d+)?)", cell).group(1).partition("/")
        return int(num) / int(den or 1)

    table = {}
    for line in lines:
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells[0] in MUP:
            table[cells[0]] = {c: power(v) for c, v in zip(columns[2:], cells[2:], strict=True)}
    return table


COLUMNS = {
    "init std (normal)": "init_normal",
    "init std (xavier)": "init_xavier",
    "AdamW lr": "adamw_lr",
    "Muon lr": "muon_lr",
    "Muon lr (muon_rms)": "muon_rms_lr",
    "output": "output",
}


def test_the_code_reads_the_table_of_the_reference():
    table = reference_table()
    assert set(table) == set(MUP)
    for role, row in table.items():
        assert set(row) == set(COLUMNS)
        for column, field in COLUMNS.items():
            assert getattr(MUP[role], field) == (row[column] or 0.0), (role, column)


M = 4  # the width multiplier of the measured models: d_model 64 over base 16
PRESETS = {
    "gpt2-tiny": dict(scan_layers=True),  # normal init, tied head, fused q/k/v
    # xavier, encoder-decoder, untied head, a relative-position table (of the heads: not grown)
    "transformer-tiny": dict(tie_embeddings=False, positions="relative"),
    "bert-tiny": dict(num_classes=3),  # classifier, pooler, MLM-free
    "llama-tiny": dict(),  # GQA, SwiGLU, no biases
}


def pair(preset, **changes):
    """The standard model and the muP one of ``preset`` at ``m = 4`` (its MLP 4 x d_model: it
    grows too), from the same seed."""
    cfg = ModelConfig.from_preset(preset, **{**PRESETS[preset], "d_ff": None, **changes})
    mup = cfg.replace(parametrization="mup", mup_base_width=cfg.d_model // M)
    return cfg, mup


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_each_parameter_starts_and_learns_as_the_table_says(preset):
    """Against the standard model of the same width: each parameter's initial standard
    deviation times ``m`` to its init power (by its init scheme), and the first update of
    AdamW and of Muon (both with and without ``muon_rms``) times ``m`` to its rate power."""
    table = reference_table()
    cfg, mup = pair(preset)
    models = {name: build_model(c, rngs=nnx.Rngs(0)) for name, c in (("sp", cfg), ("mup", mup))}
    kernels = parameter_roles(models["mup"], growing_axes(mup))
    roles = {"/".join(map(str, k)): v.role for k, v in kernels.items()}
    params = {name: flat(nnx.state(m, nnx.Param)) for name, m in models.items()}
    init_column = f"init std ({cfg.init})"
    for path, value in params["sp"].items():
        if value.size < 100 or value.std() == 0:  # biases, norms: zeros and ones
            continue
        ratio = params["mup"][path].std() / value.std()
        assert ratio == pytest.approx(M ** table[roles[path]][init_column], rel=0.12), path

    grads = random_grads(nnx.state(models["sp"], nnx.Param), seed=3)
    optimizers = [("adamw", "AdamW lr", None)]
    if preset in ("gpt2-tiny", "llama-tiny"):  # Muon's rates: fused and apart q/k/v
        optimizers += [("muon", "Muon lr", None), ("muon", "Muon lr (muon_rms)", 0.2)]
    for name, column, muon_rms in optimizers:
        opt = OptimizerConfig(
            name=name, lr=0.1, schedule="constant", warmup_steps=0, weight_decay=0.0
        )
        opt = OptimizerConfig(**{**opt.__dict__, "muon_rms": muon_rms})
        moved = {}
        for which, c in (("sp", cfg), ("mup", mup)):
            model = build_model(c, rngs=nnx.Rngs(0))
            tx, _ = make_optimizer(opt, c, total_steps=1)
            moved[which] = flat(nnx.Optimizer(model, tx, wrt=nnx.Param).update(model, grads))
        for path, update in moved["sp"].items():
            power = table[roles[path]][column]
            if power is None:  # Muon leaves the role to AdamW
                power = table[roles[path]]["AdamW lr"]
            ratio = np.linalg.norm(moved["mup"][path]) / np.linalg.norm(update)
            assert ratio == pytest.approx(M**power, rel=1e-4), (path, column)


def test_the_logits_and_the_attention_take_the_table_multipliers():
    """The muP model holding the standard model's parameters: with the standard attention scale
    its logits are the standard ones times ``m^-1``; with its own, the attention logits are
    ``sqrt(Dh / m) / Dh`` instead of ``1 / sqrt(Dh)`` (checked through the standard model given
    that scale)."""
    table = reference_table()
    cfg, mup = pair("gpt2-tiny", scan_layers=False)
    sp_model, mup_model = build_model(cfg, rngs=nnx.Rngs(0)), build_model(mup, rngs=nnx.Rngs(1))
    nnx.update(mup_model, nnx.state(sp_model, nnx.Param))
    sp_model.eval(), mup_model.eval()  # no dropout
    tokens = jax.random.randint(jax.random.key(0), (2, 12), 1, cfg.vocab_size)
    expected_scale = np.sqrt(cfg.head_dim / M) / cfg.head_dim
    assert attention_scale(mup) == pytest.approx(expected_scale, rel=1e-12)

    mup_logits = mup_model(tokens)
    set_attention_scale(mup_model, None)
    output = M ** table["output"]["output"]
    np.testing.assert_allclose(mup_model(tokens), sp_model(tokens) * output, rtol=2e-5, atol=1e-6)
    assert not np.allclose(mup_logits, mup_model(tokens), rtol=1e-3)
    set_attention_scale(sp_model, expected_scale)
    np.testing.assert_allclose(mup_logits, sp_model(tokens) * output, rtol=2e-5, atol=1e-6)


def set_attention_scale(model, scale):
    for _, node in nnx.iter_graph(model):
        if isinstance(node, MultiHeadAttention):
            node.scale = scale


@pytest.mark.parametrize("preset", ["gpt2-tiny", "transformer-tiny"])
def test_mup_at_its_base_width_is_the_standard_parametrization(preset):
    cfg = ModelConfig.from_preset(preset)
    mup = cfg.replace(parametrization="mup", mup_base_width=cfg.d_model)
    sp_model, mup_model = build_model(cfg, rngs=nnx.Rngs(0)), build_model(mup, rngs=nnx.Rngs(0))
    sp_model.eval(), mup_model.eval()
    sp, mp = flat(nnx.state(sp_model, nnx.Param)), flat(nnx.state(mup_model, nnx.Param))
    assert sp.keys() == mp.keys() and all(np.array_equal(sp[k], mp[k]) for k in sp)
    tokens = jax.random.randint(jax.random.key(0), (2, 12), 1, cfg.vocab_size)
    args = (tokens, tokens) if cfg.kind == "encoder_decoder" else (tokens,)
    np.testing.assert_allclose(mup_model(*args), sp_model(*args), rtol=1e-6, atol=1e-6)


def test_a_mup_model_away_from_its_base_width_is_not_written_as_hugging_face():
    from flaxformer_lite.interop.hf import writable_family

    cfg, mup = pair("gpt2-tiny")
    assert writable_family(cfg) is not None
    assert writable_family(cfg.replace(parametrization="mup", mup_base_width=cfg.d_model))
    with pytest.raises(ValueError, match="parametrization=mup at 4x its base width"):
        writable_family(mup)


def test_mup_keeps_the_decay_per_step_and_grows_only_what_grows():
    """With no gradient, a hidden matrix decays by ``lr * weight_decay`` per step under muP as
    under the standard (the mup package's MuAdamW); an MLP of fixed ``d_ff`` does not grow, so
    its kernels are not hidden; a relative-position table (of the heads) is not an input."""
    cfg, mup = pair("gpt2-tiny", scan_layers=False)
    opt = OptimizerConfig(lr=0.1, schedule="constant", warmup_steps=0, weight_decay=0.5)
    for c in (cfg, mup):
        model = build_model(c, rngs=nnx.Rngs(0))
        before = flat(jax.tree.map(np.asarray, nnx.state(model, nnx.Param)))
        tx, _ = make_optimizer(opt, c, total_steps=1)
        zeros = jax.tree.map(jnp.zeros_like, nnx.state(model, nnx.Param))
        moved = flat(nnx.Optimizer(model, tx, wrt=nnx.Param).update(model, zeros))
        path = "decoder/layers/layers/0/mlp/wi/kernel"
        np.testing.assert_allclose(moved[path], -0.1 * 0.5 * before[path], rtol=1e-6)
    fixed = mup.replace(d_ff=256)
    roles = {
        k[-2:]: v.role
        for k, v in parameter_roles(
            build_model(fixed, rngs=nnx.Rngs(0)), growing_axes(fixed)
        ).items()
    }
    assert roles[("wi", "kernel")] == "output" and roles[("wo", "kernel")] == "input"
    assert roles[("qkv", "kernel")] == "hidden"
    t5 = ModelConfig.from_preset("transformer-tiny", positions="relative")
    t5 = t5.replace(parametrization="mup", mup_base_width=16)
    kernels = parameter_roles(build_model(t5, rngs=nnx.Rngs(0)), growing_axes(t5))
    tables = [v.role for k, v in kernels.items() if "relative" in "/".join(map(str, k))]
    assert tables and set(tables) == {"vector"}


def test_a_base_width_is_kept_unread_under_the_standard_parametrization():
    """So a sweep can vary model.parametrization over standard and mup with one base."""
    cfg = ModelConfig.from_preset("gpt2-tiny", mup_base_width=16)
    assert cfg.width_multiplier is None and attention_scale(cfg) is None


def test_a_d_ff_set_or_derived_alike_keeps_its_own_roles():
    """Equal as values (d_ff 256 at d_model 64), set and derived differ in what grows."""
    from flaxformer_lite.train.optim import model_kernels

    derived = ModelConfig.from_preset("gpt2-tiny", d_ff=None).replace(
        parametrization="mup", mup_base_width=16
    )
    set_ = derived.replace(d_ff=4 * derived.d_model)
    assert set_ == derived  # the dataclass compares values
    wi = ("decoder", "layers", "layers", 0, "mlp", "wi", "kernel")
    assert model_kernels(derived)[wi].role == "hidden"
    assert model_kernels(set_)[wi].role == "output"
