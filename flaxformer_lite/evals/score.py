"""Scoring requests with a model: packed rows through one jitted program, each request's
log-likelihood and greedy flag summed on the devices.

    scorer = Scorer(rows=8, length=64)
    loglikelihood, greedy = scorer(model, requests)

On a mesh, each process builds every batch (the same on all of them) and places its own rows
(``place``, ``shard``), as the training batches are placed; the sums come back whole to every
process.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec

from flaxformer_lite import ops
from flaxformer_lite.data.tasks import TASKS
from flaxformer_lite.evals.requests import Request, pack
from flaxformer_lite.models.heads import head_projection
from flaxformer_lite.nn.context_parallel import sequence_shards, to_context_layout


def request_scores(
    model, batch: dict, *, num_requests: int, loss_chunk: int | None = None
) -> dict[str, jax.Array]:
    """Each request's log-likelihood and whether it is greedy, from a packed ``lm`` batch whose
    ``weights`` mark the tokens scored and whose int ``request [B, T]`` says which request each
    belongs to (``0 <= request < num_requests`` where the weight is not 0):
    ``{"loglikelihood": [R], "greedy": [R]}``, float32 sums of ``log p(target)`` and whether
    every scored target is the argmax (a request with no token: 0 and True).

    The sums are over tokens in any order, so a sequence split over ``mesh.context`` devices is
    scored where it lies. With ``loss_chunk``, the logits of ``loss_chunk`` positions at a time
    (``ops.chunked_token_log_likelihood``).
    """
    shards = sequence_shards()
    if shards > 1:
        batch = to_context_layout(batch, shards)
    features = loss_chunk is not None
    outputs = TASKS["lm"].predict(model, batch, features=features)
    if features:
        log_p, greedy = ops.chunked_token_log_likelihood(
            outputs, batch["targets"], head_projection(model), chunk=loss_chunk
        )
    else:
        log_p, greedy = ops.token_log_likelihood(outputs, batch["targets"])
    scored = batch["weights"] > 0
    # Tokens not scored go to one segment past the requests, dropped.
    segments = jnp.where(scored, batch["request"], num_requests).reshape(-1)
    sums = functools.partial(jax.ops.segment_sum, num_segments=num_requests + 1)
    loglikelihood = sums(jnp.where(scored, log_p, 0.0).reshape(-1), segments)
    misses = sums((scored & ~greedy).astype(jnp.int32).reshape(-1), segments)
    return {"loglikelihood": loglikelihood[:-1], "greedy": misses[:-1] == 0}


@functools.partial(jax.jit, static_argnums=(0,), static_argnames=("loss_chunk",))
def _score_batch(graphdef, params, batch, *, loss_chunk):
    model = nnx.merge(graphdef, params)
    scores = request_scores(model, batch, num_requests=batch["inputs"].size, loss_chunk=loss_chunk)
    if not jax.sharding.get_abstract_mesh().empty:  # every process reads them whole
        scores = jax.lax.with_sharding_constraint(scores, PartitionSpec())
    return scores


class Scorer:
    """Scores requests in batches of ``rows x length`` positions.

    Args:
      rows: rows per batch (global, over every process).
      length: positions per row; a longer request is cut from the left.
      place: puts this process's rows of a batch onto the devices (default: ``jnp.asarray``).
      shard: ``(index, count)``: this process holds rows ``[index * rows / count, ...)``.
      loss_chunk: as :func:`request_scores`.
    """

    def __init__(
        self,
        *,
        rows: int,
        length: int,
        place: Callable | None = None,
        shard: tuple[int, int] = (0, 1),
        loss_chunk: int | None = None,
    ):
        self.rows, self.length, self.loss_chunk = rows, length, loss_chunk
        self.place = place or (lambda batch: {k: jnp.asarray(v) for k, v in batch.items()})
        index, count = shard
        share = rows // count
        self._rows = slice(index * share, (index + 1) * share)

    def __call__(self, model, requests: Sequence[Request]) -> tuple[np.ndarray, np.ndarray]:
        """``(loglikelihood float64 [N], greedy bool [N])`` of ``requests`` under ``model``
        (an nnx module in eval mode)."""
        graphdef, params = nnx.split(model)
        loglikelihood = np.zeros(len(requests), np.float64)
        greedy = np.ones(len(requests), bool)
        pending = []  # every batch is dispatched before the first result is read
        for batch, indices in pack(requests, rows=self.rows, length=self.length):
            local = self.place({key: value[self._rows] for key, value in batch.items()})
            scores = _score_batch(graphdef, params, local, loss_chunk=self.loss_chunk)
            pending.append((scores, indices))
        for scores, indices in pending:
            count = len(indices)
            loglikelihood[indices] = np.asarray(scores["loglikelihood"])[:count]
            greedy[indices] = np.asarray(scores["greedy"])[:count]
        return loglikelihood, greedy
