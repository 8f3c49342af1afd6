"""Our training step as only its matmuls: every ``dot_general`` of its jaxpr (forward and
backward), compiled by XLA and timed alone, and the same products in PyTorch (``torch.einsum``).

These are our step's products, not the ones Hugging Face's step runs (it fuses its attention):
what our step would take if it were only its matmuls, at either framework's matmul speed, is an
optimistic floor that ``train_step.py`` sets against both steps and its target.
"""

from __future__ import annotations

import collections
import functools
import string
import time

import jax
import numpy as np
from jax.extend import core as jax_core

MATMUL_REPEATS = 3  # each matmul's best of this many calls, once per window


def step_matmuls(jaxpr) -> tuple[collections.Counter, int]:
    """How many times a step runs each matmul: ``{(lhs shape, rhs shape, lhs dtype, rhs dtype,
    dimension_numbers, preferred_element_type): count}`` over the ``dot_general`` equations of
    its jaxpr (``jax.extend.core.Jaxpr``), and the number of while loops that hold matmuls.

    A scan's body counts ``length`` times; of a cond's branches, the one with the fewest matmul
    FLOPs (so the sum never counts work that may not run); a while loop's body once, its trip
    count not being in the jaxpr (chunked attention's ``fori_loop`` over key blocks), so that
    with loops the counts are a floor.
    """
    counts, loops = collections.Counter(), 0
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "dot_general":
            lhs, rhs = (var.aval for var in eqn.invars)
            dims, preferred = eqn.params["dimension_numbers"], eqn.params["preferred_element_type"]
            counts[(lhs.shape, rhs.shape, lhs.dtype.name, rhs.dtype.name, dims, preferred)] += 1
            continue
        if name == "cond":
            branches = [step_matmuls(branch.jaxpr) for branch in eqn.params["branches"]]
            branch_counts, branch_loops = min(branches, key=lambda branch: matmul_flops(branch[0]))
            counts.update(branch_counts)
            loops += branch_loops
            continue
        repeat = eqn.params["length"] if name == "scan" else 1
        inner = collections.Counter()
        for sub in jax_core.jaxprs_in_params(eqn.params):
            sub_counts, sub_loops = step_matmuls(sub)
            inner.update(sub_counts)
            loops += sub_loops
        counts.update({key: repeat * n for key, n in inner.items()})
        if name == "while" and inner:
            loops += 1
    return counts, loops


def matmul_flops(counts: collections.Counter) -> int:
    """The FLOPs of ``counts`` (:func:`step_matmuls`): 2 x the lhs's elements x the rhs's free
    elements, per matmul."""
    total = 0
    for (lhs, rhs, _, _, ((_, rhs_contracting), (_, rhs_batch)), _), n in counts.items():
        shared = rhs_contracting + rhs_batch
        rhs_free = [size for axis, size in enumerate(rhs) if axis not in shared]
        total += n * 2 * int(np.prod(lhs)) * int(np.prod(rhs_free))
    return total


def einsum_spec(lhs_rank: int, rhs_rank: int, dimension_numbers) -> str:
    """The ``einsum`` equation of a ``dot_general``: output axes are batch, lhs free, rhs free."""
    (lhs_contracting, rhs_contracting), (lhs_batch, rhs_batch) = dimension_numbers
    letters = iter(string.ascii_letters)
    lhs = [next(letters) for _ in range(lhs_rank)]
    rhs = [None] * rhs_rank
    for i, j in zip(lhs_contracting + lhs_batch, rhs_contracting + rhs_batch, strict=True):
        rhs[j] = lhs[i]  # contracted and batch axes share a letter
    rhs = [letter or next(letters) for letter in rhs]
    lhs_shared, rhs_shared = lhs_contracting + lhs_batch, rhs_contracting + rhs_batch
    out = [lhs[i] for i in lhs_batch] + [x for i, x in enumerate(lhs) if i not in lhs_shared]
    out += [x for j, x in enumerate(rhs) if j not in rhs_shared]
    return f"{''.join(lhs)},{''.join(rhs)}->{''.join(out)}"


def best_seconds(call, *args) -> float:
    """The fastest of ``MATMUL_REPEATS`` calls of ``call(*args)`` (waiting for its result),
    after one untimed call."""
    jax.block_until_ready(call(*args))
    best = float("inf")
    for _ in range(MATMUL_REPEATS):
        start = time.perf_counter()
        jax.block_until_ready(call(*args))
        best = min(best, time.perf_counter() - start)
    return best


class StepMatmuls:
    """The step's matmuls (:func:`step_matmuls`), each compiled by XLA and timed alone, and the
    same products in PyTorch (``torch.einsum``) when ``torch`` is given: the time the step's
    arithmetic takes at each framework's matmul speed, with nothing else running."""

    def __init__(self, jaxpr, torch=None):
        self.counts, self.while_loops = step_matmuls(jaxpr)
        self.flops = matmul_flops(self.counts)
        self.torch = torch
        rng = np.random.default_rng(0)
        self.xla, self.torch_products = [], []  # (count, compiled or equation, lhs, rhs)
        for key, n in self.counts.items():
            lhs, rhs, lhs_dtype, rhs_dtype, dimension_numbers, preferred = key
            a = rng.standard_normal(lhs).astype(lhs_dtype)
            b = rng.standard_normal(rhs).astype(rhs_dtype)
            a_device, b_device = jax.device_put(a), jax.device_put(b)
            matmul = functools.partial(
                jax.lax.dot_general,
                dimension_numbers=dimension_numbers,
                preferred_element_type=preferred,
            )
            compiled = jax.jit(matmul).lower(a_device, b_device).compile()
            self.xla.append((n, compiled, a_device, b_device))
            if torch is not None:
                spec = einsum_spec(len(lhs), len(rhs), dimension_numbers)
                self.torch_products.append((n, spec, torch.from_numpy(a), torch.from_numpy(b)))

    def seconds(self) -> tuple[float, float | None]:
        """Seconds per step of the step's matmuls in XLA and in PyTorch (``None`` without it):
        each matmul's best of ``MATMUL_REPEATS`` calls times the times the step runs it."""
        xla = sum(n * best_seconds(compiled, a, b) for n, compiled, a, b in self.xla)
        if self.torch is None:
            return xla, None
        einsum = self.torch.einsum
        return xla, sum(n * best_seconds(einsum, *args) for n, *args in self.torch_products)
