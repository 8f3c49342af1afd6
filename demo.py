"""A tour of flaxformer_lite on the CPU: attention, masks, RoPE, norms, the loss, the models.

    python demo.py

Each step prints what it computed and checks it against an independent formula, so a broken
install shows up here before anything else.
"""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from flaxformer_lite import ops
from flaxformer_lite.models import PRESETS, ModelConfig, build_model, parameter_counts


def main():
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
        print(f"attention {name:8s} {tuple(out.shape)}  max |ours - jax.nn| = {error:.1e}")
    padded_rows = np.asarray(outputs["chunked"])[1, length - 100 :]
    print(f"padded query rows are exactly zero: {bool(np.all(padded_rows == 0))}")

    # The chunked implementation's backward pass needs O(T) memory.
    def grad_temp_mib(implementation, t=4096):
        x = jax.ShapeDtypeStruct((1, t, 8, 64), jnp.float32)

        def loss(q, k, v):
            return ops.dot_product_attention(
                q, k, v, is_causal=True, implementation=implementation
            ).sum()

        compiled = jax.jit(jax.grad(loss, (0, 1, 2))).lower(x, x, x).compile()
        return compiled.memory_analysis().temp_size_in_bytes / 2**20

    print(
        "fwd+bwd temp memory at T=4096: "
        f"xla {grad_temp_mib('xla'):.0f} MiB, chunked {grad_temp_mib('chunked'):.0f} MiB"
    )

    # RoPE: the logit between rotated vectors depends only on the distance.
    x = jnp.asarray(rng.standard_normal((1, 1, 1, 64)), jnp.float32)
    y = jnp.asarray(rng.standard_normal((1, 1, 1, 64)), jnp.float32)

    def rotated_dot(m, n):
        rotated_x, rotated_y = ops.apply_rope(x, jnp.array([m])), ops.apply_rope(y, jnp.array([n]))
        return float(jnp.sum(rotated_x * rotated_y))

    near, far = rotated_dot(3, 10), rotated_dot(103, 110)
    print(f"RoPE <q@3, k@10> = {near:.5f}, <q@103, k@110> = {far:.5f}")

    normed = ops.layer_norm(q)
    print(f"layer_norm: mean {float(normed.mean()):.1e}, std {float(normed.std()):.4f}")
    logits = jnp.asarray(rng.standard_normal((batch, length, 100)), jnp.float32)
    targets = jnp.asarray(rng.integers(0, 100, (batch, length)))
    weights = real[:, :, 0, 0]
    loss, metrics = ops.cross_entropy(logits, targets, weights=weights, label_smoothing=0.1)
    print(f"cross_entropy: loss {float(loss):.4f} over {int(metrics['num_tokens'])} real tokens")
    tour_models(rng)


def tour_models(rng):
    """Preset sizes (shapes only, nothing allocated) and KV-cache decoding vs the full pass."""
    for name in PRESETS:
        cfg = ModelConfig.from_preset(name)
        counts = parameter_counts(cfg)
        print(f"{name:17s} {cfg.kind:16s} {counts['total'] / 1e6:9.2f}M parameters")

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
    print(f"llama-tiny: KV-cache decoding vs full forward, max |difference| = {error:.1e}")


if __name__ == "__main__":
    main()
