"""A deliberately naive float64 NumPy attention, independent of the library's code.

It checks ``ops.reference_attention`` itself (test_attention_reference.py), against which the
implementations are then tested, and the ``nn`` modules (test_nn_attention.py).
"""

import numpy as np


def naive_attention_probs(q, k, bias=None, mask=None, *, scale=None, causal=False, window=None):
    """Softmax probabilities ``[B, H, T, S]`` computed element by element in float64."""
    q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
    b, tq, hq, d = q.shape
    tk, hk = k.shape[1], k.shape[2]
    scale = 1.0 / np.sqrt(d) if scale is None else scale
    bias = np.zeros((1, 1, 1, 1)) if bias is None else np.asarray(bias, np.float64)
    mask = np.ones((1, 1, 1, 1), bool) if mask is None else np.asarray(mask)
    bias = np.broadcast_to(bias.reshape((1,) * (4 - bias.ndim) + bias.shape), (b, hq, tq, tk))
    mask = np.broadcast_to(mask.reshape((1,) * (4 - mask.ndim) + mask.shape), (b, hq, tq, tk))
    probs = np.zeros((b, hq, tq, tk))
    group = hq // hk
    for bi in range(b):
        for h in range(hq):
            for i in range(tq):
                position = i + tk - tq  # the last query is aligned with the last key
                allowed = []
                for j in range(tk):
                    ok = bool(mask[bi, h, i, j])
                    ok &= not causal or j <= position
                    if window is not None:
                        ok &= position - window[0] <= j <= position + window[1]
                    allowed.append(ok)
                allowed = np.array(allowed)
                if not allowed.any():
                    continue  # a fully masked row stays zero
                logits = np.array(
                    [
                        scale * q[bi, i, h] @ k[bi, j, h // group] + bias[bi, h, i, j]
                        for j in range(tk)
                    ]
                )
                logits = np.where(allowed, logits, -np.inf)
                e = np.exp(logits - logits.max())
                probs[bi, h, i] = e / e.sum()
    return probs


def naive_attention(q, k, v, bias=None, mask=None, *, keep=None, dropout_rate=0.0, **kwargs):
    """``[B, T, H, Dv]`` float64; ``keep`` is an explicit ``[B, H, T, S]`` dropout mask."""
    probs = naive_attention_probs(q, k, bias, mask, **kwargs)
    if keep is not None:
        probs = np.where(keep, probs / (1.0 - dropout_rate), 0.0)
    v = np.asarray(v, np.float64)
    group = q.shape[2] // v.shape[2]
    v_per_query_head = np.repeat(v, group, axis=2)  # [B, S, H, Dv]
    return np.einsum("bhqk,bkhd->bqhd", probs, v_per_query_head)
