"""A tour of flaxformer_lite on the CPU: attention, masks, RoPE, norms, the loss, the models.

    python demo.py

Each step prints what it computed and checks it against an independent formula (``jax.nn``,
NumPy in float64, published parameter counts); a failed check is named at the end and the demo
exits with status 1, so a broken install shows up here before anything else.
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from flaxformer_lite import ops
from flaxformer_lite.models import PRESETS, ModelConfig, build_model, parameter_counts

# Published parameter counts (Hugging Face's GPT2LMHeadModel, BertForMaskedLM, Llama 3.2 1B)
# of the presets that have the same shape.
PUBLISHED_PARAMETERS = {
    "gpt2-small": 124_439_808,
    "gpt2-medium": 354_823_168,
    "bert-base": 109_514_298,
    "llama-style": 1_235_814_400,
}


class Checks:
    """Prints each check as it is made and remembers the ones that failed."""

    def __init__(self):
        self.failed, self.count = [], 0

    def __call__(self, name: str, passed: bool, detail: str) -> None:
        self.count += 1
        print(f"{'ok    ' if passed else 'FAILED'} {name}: {detail}")
        if not passed:
            self.failed.append(name)


def main() -> int:
    """Runs every check; 0 if all pass, else 1 after naming those that failed."""
    check = Checks()
    tour_ops(check)
    tour_models(check)
    if check.failed:
        print(f"{len(check.failed)} of {check.count} checks failed: {', '.join(check.failed)}")
        return 1
    print(f"all {check.count} checks passed")
    return 0


def tour_ops(check: Checks) -> None:
    """Attention (two implementations against ``jax.nn``), its memory, RoPE, the norm and the
    loss against their formulas."""
    rng = np.random.default_rng(0)
    batch, length, heads, num_kv_heads, head_dim = 2, 256, 8, 2, 32
    q = jnp.asarray(rng.standard_normal((batch, length, heads, head_dim)), jnp.float32)
    k, v = (
        jnp.asarray(rng.standard_normal((batch, length, num_kv_heads, head_dim)), jnp.float32)
        for _ in range(2)
    )
    lengths = jnp.array([length, length - 100])
    print(f"jax {jax.__version__} on {jax.default_backend()}")

    # Grouped-query causal attention over padded rows, three ways.
    mask = ops.padding_mask(lengths, q_len=length)
    attend = jax.jit(ops.dot_product_attention, static_argnames=("is_causal", "implementation"))
    outputs = {
        name: attend(q, k, v, mask=mask, is_causal=True, implementation=name)
        for name in ("xla", "chunked")
    }
    expanded = [jnp.repeat(x, heads // num_kv_heads, axis=2) for x in (k, v)]
    reference = jax.nn.dot_product_attention(q, *expanded, mask=mask, is_causal=True)
    real = np.asarray(jnp.arange(length)[None, :, None, None] < lengths[:, None, None, None])
    for name, out in outputs.items():
        error = float(jnp.max(jnp.abs(jnp.where(real, out - reference, 0.0))))
        # float32 round-off, about 1e-6 here: 1e-5 leaves a margin on any CPU
        check(f"attention {name}", error < 1e-5, f"max |ours - jax.nn| = {error:.1e} (< 1e-5)")
    for name, out in outputs.items():
        padded_rows = np.asarray(out)[1, length - 100 :]
        check(
            f"attention {name} padding", bool(np.all(padded_rows == 0)), "padded query rows are 0"
        )

    # The chunked implementation's backward pass needs O(T) memory.
    def grad_temp_mib(implementation, t=4096):
        x = jax.ShapeDtypeStruct((1, t, 8, 64), jnp.float32)

        def loss(q, k, v):
            return ops.dot_product_attention(
                q, k, v, is_causal=True, implementation=implementation
            ).sum()

        compiled = jax.jit(jax.grad(loss, (0, 1, 2))).lower(x, x, x).compile()
        return compiled.memory_analysis().temp_size_in_bytes / 2**20

    xla_mib, chunked_mib = grad_temp_mib("xla"), grad_temp_mib("chunked")
    check(
        "chunked attention memory",
        chunked_mib < xla_mib / 4,
        f"fwd+bwd temporaries at T=4096: xla {xla_mib:.0f} MiB, chunked {chunked_mib:.0f} MiB",
    )

    # RoPE: the logit between rotated vectors depends only on the distance.
    x = jnp.asarray(rng.standard_normal((1, 1, 1, 64)), jnp.float32)
    y = jnp.asarray(rng.standard_normal((1, 1, 1, 64)), jnp.float32)

    def rotated_dot(m, n):
        rotated_x, rotated_y = ops.apply_rope(x, jnp.array([m])), ops.apply_rope(y, jnp.array([n]))
        return float(jnp.sum(rotated_x * rotated_y))

    near, far = rotated_dot(3, 10), rotated_dot(103, 110)
    check(
        "RoPE",
        abs(near - far) < 1e-4,
        f"<q@3, k@10> = {near:.5f}, <q@103, k@110> = {far:.5f} (the same distance)",
    )

    x64, eps = np.asarray(q, np.float64), 1e-5
    mean, var = x64.mean(-1, keepdims=True), x64.var(-1, keepdims=True)
    normed = np.asarray(ops.layer_norm(q, eps=eps))
    error = float(np.max(np.abs(normed - (x64 - mean) / np.sqrt(var + eps))))
    check("layer_norm", error < 1e-5, f"max |ours - float64 formula| = {error:.1e} (< 1e-5)")

    vocab, smoothing = 100, 0.1
    logits = jnp.asarray(rng.standard_normal((batch, length, vocab)), jnp.float32)
    targets = jnp.asarray(rng.integers(0, vocab, (batch, length)))
    weights = real[:, :, 0, 0]
    loss, metrics = ops.cross_entropy(logits, targets, weights=weights, label_smoothing=smoothing)
    log_p = np.asarray(jax.nn.log_softmax(np.asarray(logits, np.float64)))
    target_log_p = np.take_along_axis(log_p, np.asarray(targets)[..., None], -1)[..., 0]
    per_token = -(1 - smoothing) * target_log_p - smoothing * log_p.mean(-1)
    expected = float(per_token[weights].mean())
    check(
        "cross_entropy",
        abs(float(loss) - expected) < 1e-5 and int(metrics["num_tokens"]) == weights.sum(),
        f"loss {float(loss):.6f} over {int(metrics['num_tokens'])} real tokens, float64 "
        f"formula {expected:.6f}",
    )


def tour_models(check: Checks) -> None:
    """Preset sizes (shapes only, nothing allocated) against published counts, and KV-cache
    decoding against the full pass."""
    rng = np.random.default_rng(0)
    for name in PRESETS:
        cfg = ModelConfig.from_preset(name)
        total = parameter_counts(cfg)["total"]
        print(f"       {name:17s} {cfg.kind:16s} {total / 1e6:9.2f}M parameters")
        if name in PUBLISHED_PARAMETERS:
            published = PUBLISHED_PARAMETERS[name]
            check(
                f"{name} size", total == published, f"{total:,} parameters, published {published:,}"
            )

    model = build_model(ModelConfig.from_preset("llama-tiny"), rngs=nnx.Rngs(0))
    model.eval()
    tokens = jnp.asarray(rng.integers(0, 256, (2, 12)))
    full = nnx.jit(lambda m, t: m(t))(model, tokens)
    model.init_cache(batch_size=2, max_length=16)
    step = nnx.jit(lambda m, t: m(t, decode=True))
    pieces = [step(model, tokens[:, :4])] + [
        step(model, tokens[:, i : i + 1]) for i in range(4, 12)
    ]
    error = float(jnp.max(jnp.abs(jnp.concatenate(pieces, axis=1) - full)))
    check(
        "KV-cache decoding",
        error < 1e-5,
        f"llama-tiny, chunk by chunk vs the full forward: max |difference| = {error:.1e}",
    )


if __name__ == "__main__":
    sys.exit(main())
