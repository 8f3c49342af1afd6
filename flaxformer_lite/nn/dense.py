"""Parameters with logical axis names, their initializers, and the one projection every module uses.

Every parameter is an ``nnx.Param`` whose ``out_sharding`` metadata holds *logical* axis names
(``"embed"``, ``"heads"``, ``"mlp"``, ...). Nothing is placed on devices when a parameter is created
(``eager_sharding=False``): sharding maps the names to mesh axes with rules and initializes under
``jax.jit`` with the resulting shardings, so a model builds the same way on one CPU and on a pod.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from flaxformer_lite.choices import INIT_SCHEMES, WIDTH_AXES
from flaxformer_lite.nn.parametrization import Kernel, multiplier, role_of
from flaxformer_lite.nn.rngs import next_key
from flaxformer_lite.ops.projection import project

# The name of an adapted projection's output (:mod:`.lora`): the remat policies that save
# matmul outputs save it (:data:`~.stack.REMAT_POLICIES`).
ADAPTED = "adapted_projection"


def param(rngs: nnx.Rngs, init, shape: tuple[int, ...], names: tuple, dtype) -> nnx.Param:
    """A parameter initialized as ``init(key, shape, dtype)`` and tagged with logical axis names."""
    if len(names) != len(shape):
        raise ValueError(f"parameter of shape {shape} needs {len(shape)} axis names, got {names}")
    return nnx.Param(
        init(next_key(rngs.params), shape, dtype), out_sharding=names, eager_sharding=False
    )


@dataclasses.dataclass(frozen=True)
class KernelInit:
    """How a projection kernel ``[*in_shape, *out_shape]`` is initialized.

    Attributes:
      scheme: ``"xavier"`` (Glorot uniform over fan_in + fan_out, as in Tensor2Tensor's
        Transformer; the paper does not state its initialization) or ``"normal"`` (a normal with
        standard deviation ``std``, as in GPT-2, BERT and LLaMA).
      std: standard deviation of ``"normal"``.
      scale: extra factor on the standard deviation; GPT-2 multiplies the projections that
        write into the residual stream by ``1 / sqrt(2 * num_layers)``.
      width_multiplier: muP's ``m = d_model / base_width``: each kernel's standard deviation
        times its role's power of ``m`` (:data:`~.parametrization.MUP`); None: the standard
        parametrization.
      growing: the logical axes that grow with the width, which give a kernel its role.
    """

    scheme: str = "xavier"
    std: float = 0.02
    scale: float = 1.0
    width_multiplier: float | None = None
    growing: frozenset = WIDTH_AXES

    def __post_init__(self):
        if self.scheme not in INIT_SCHEMES:
            raise ValueError(f"init must be one of {INIT_SCHEMES}, got {self.scheme!r}")

    def scaled(self, factor: float) -> KernelInit:
        return dataclasses.replace(self, scale=self.scale * factor)

    def _check_placed(self) -> None:
        if self.width_multiplier is not None:
            raise ValueError(
                "a muP initialization needs the parameter's role first: "
                "init.for_role(role_of(names, num_in_axes, init.growing)).kernel(...)"
            )

    def for_role(self, role: str) -> KernelInit:
        """This initialization for a parameter of ``role`` (muP's multiplier of its scheme)."""
        factor = multiplier(f"init_{self.scheme}", role, self.width_multiplier)
        return dataclasses.replace(self.scaled(factor), width_multiplier=None)

    def kernel(
        self, num_in_axes: int, fused_axes: tuple[int, ...] = (), split: tuple[int, ...] = ()
    ):
        """An initializer ``(key, shape, dtype) -> array``.

        The first ``num_in_axes`` axes are inputs, the others outputs; ``fused_axes`` are output
        axes that index separate projections stored together (q/k/v), left out of the fans.
        ``split`` gives the sizes of separate projections concatenated along the first output
        axis (a grouped q/k/v kernel ``[D, H + 2 * Hk, Dh]``): each piece is initialized as
        its own kernel.

        Raises:
          ValueError: a muP initialization not yet given its role (:meth:`for_role`).
        """
        self._check_placed()
        if split:
            return self._concatenated(num_in_axes, fused_axes, split)
        if self.scheme == "normal":
            return nnx.initializers.normal(self.std * self.scale)
        in_axis = tuple(range(num_in_axes))

        def xavier(key, shape, dtype):
            out_axis = tuple(i for i in range(num_in_axes, len(shape)) if i not in fused_axes)
            init = nnx.initializers.variance_scaling(
                self.scale**2,
                "fan_avg",
                "uniform",
                in_axis=in_axis,
                out_axis=out_axis,
                batch_axis=fused_axes,
            )
            return init(key, shape, dtype)

        return xavier

    def _concatenated(self, num_in_axes: int, fused_axes: tuple[int, ...], split: tuple[int, ...]):
        piece_init = self.kernel(num_in_axes, fused_axes)

        def concatenated(key, shape, dtype):
            if sum(split) != shape[num_in_axes]:
                raise ValueError(f"split {split} does not add up to axis {num_in_axes} of {shape}")
            keys = jax.random.split(key, len(split))
            pieces = [
                piece_init(k, (*shape[:num_in_axes], size, *shape[num_in_axes + 1 :]), dtype)
                for k, size in zip(keys, split, strict=True)
            ]
            return jnp.concatenate(pieces, axis=num_in_axes)

        return concatenated

    def embedding(self, dim: int):
        """An initializer for an embedding table ``[num_embeddings, dim]``.

        ``"xavier"`` uses a normal with std ``dim ** -0.5`` (Tensor2Tensor, fairseq): multiplied by
        ``sqrt(dim)`` as in the paper, embeddings then have unit variance.
        """
        self._check_placed()
        std = self.std if self.scheme == "normal" else dim**-0.5
        return nnx.initializers.normal(std * self.scale)


XAVIER = KernelInit()  # Tensor2Tensor's initialization, the default of every module


def _as_tuple(x) -> tuple[int, ...]:
    return (x,) if isinstance(x, int) else tuple(x)


class Dense(nnx.Module):
    """A linear projection contracting the last axes of the input: ``x @ kernel + bias``.

    ``in_shape`` and ``out_shape`` may be tuples, so the attention projections are written as
    ``[D] -> [H, Dh]`` and ``[H, Dh] -> [D]`` with no reshapes.

    Args:
      in_shape: feature axes contracted, e.g. ``768`` or ``(12, 64)``.
      out_shape: feature axes produced.
      names: logical axis names of the kernel ``[*in_shape, *out_shape]``.
      use_bias: add a bias ``[*out_shape]`` (its names are the output part of ``names``).
      init: a :class:`KernelInit`; biases start at zero.
      fused_axes: kernel axes that stack separate projections (the 3 of a fused q/k/v kernel
        ``[D, 3, H, Dh]``): each is initialized as if it were its own kernel.
      split: sizes of separate projections concatenated along the first output axis (a
        grouped q/k/v kernel ``[D, H + 2 * Hk, Dh]``), each initialized as its own kernel.
      dtype: compute dtype (inputs and kernel are cast to it); param_dtype: storage dtype.
    """

    def __init__(
        self,
        in_shape,
        out_shape,
        *,
        names: tuple,
        use_bias: bool = True,
        init: KernelInit = XAVIER,
        fused_axes: tuple[int, ...] = (),
        split: tuple[int, ...] = (),
        dtype=jnp.float32,
        param_dtype=jnp.float32,
        rngs: nnx.Rngs,
    ):
        self.in_shape, self.out_shape = _as_tuple(in_shape), _as_tuple(out_shape)
        self.fused_axes, self.split, self.dtype = tuple(fused_axes), tuple(split), dtype
        shape = self.in_shape + self.out_shape
        self.role = role_of(names, len(self.in_shape), init.growing)
        self.matrix = role_of(names, len(self.in_shape)) == "hidden"
        kernel_init = init.for_role(self.role).kernel(len(self.in_shape), fused_axes, split)
        self.kernel = param(rngs, kernel_init, shape, names, param_dtype)
        self.bias = (
            param(
                rngs,
                nnx.initializers.zeros,
                self.out_shape,
                names[len(self.in_shape) :],
                param_dtype,
            )
            if use_bias
            else None
        )
        self.lora = nnx.data(None)  # a low-rank adapter (:mod:`.lora`), added to a built model

    def kernel_axes(self) -> Kernel:
        """The kernel's role and its input and output axes (after a scanned stack's layers;
        the stacked q/k/v of ``fused_axes`` are neither)."""
        layers = self.kernel.ndim - len(self.in_shape) - len(self.out_shape)
        num_in = len(self.in_shape)
        inputs = tuple(range(layers, layers + num_in))
        outputs = tuple(
            layers + num_in + i
            for i in range(len(self.out_shape))
            if num_in + i not in self.fused_axes
        )
        return Kernel(self.role, inputs, outputs, matrix=self.matrix, split=bool(self.split))

    def __call__(self, x: jax.Array) -> jax.Array:
        """``[..., *in_shape] -> [..., *out_shape]`` in the compute dtype."""
        # project raises a ValueError naming both shapes when x does not end with in_shape.
        n = len(self.in_shape)
        kernel = self.kernel[...].astype(self.dtype)
        # A kernel with an adapter is the frozen base's: no gradient of it is taken.
        y = project(x.astype(self.dtype), kernel, n, trained=self.lora is None)
        if self.bias is not None:
            y = y + self.bias[...].astype(self.dtype)
        if self.lora is not None:
            y = checkpoint_name(y + self.lora(x), ADAPTED)
        return y


def residual_scale(num_layers: int) -> float:
    """GPT-2's ``1 / sqrt(2 * num_layers)`` for the projections that write into the residual."""
    return 1.0 / math.sqrt(2 * max(num_layers, 1))
