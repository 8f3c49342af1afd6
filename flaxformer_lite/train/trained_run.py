"""Loading a trained run: the model of a checkpoint written by ``train.py``, with its tokenizer
and config, ready for inference, plots and generation.

    run = load_run("runs/default")            # the newest checkpoint (or step=N; mesh=, devices=)
    ids = jnp.asarray([[run.tokenizer.sos_id, *run.tokenizer.encode("012+034=")]])
    logits = run.model(ids)                   # [1, T, V], dropout off

The helpers that convert the training state to and from what a checkpoint holds
(:func:`to_savable`, :func:`from_savable`, :func:`restore_target`) live here and the training
loop uses them too, so a run is restored exactly as it resumes;
:func:`load_hf_weights` starts a run's state from a Hugging Face checkpoint (``init_from``), and
:func:`load_hf_checkpoint` loads such a checkpoint's model and tokenizer for inference.
"""

from __future__ import annotations

import dataclasses
import logging
import pathlib
from collections.abc import Sequence

import jax
import numpy as np
from flax import nnx, traverse_util
from jax.sharding import Mesh

from flaxformer_lite import parallel
from flaxformer_lite.data import Tokenizer, load_hf_tokenizer, load_tokenizer
from flaxformer_lite.models.config import ModelKind
from flaxformer_lite.nn.lora import lora_scale
from flaxformer_lite.registry import trusted_code
from flaxformer_lite.train.checkpoint import Checkpointer, CheckpointError
from flaxformer_lite.train.checkpoint_format import (
    base_part,
    base_record,
    check_base,
    from_savable,
    restore_target,
)
from flaxformer_lite.train.config import TrainConfig, config_from_dict
from flaxformer_lite.train.program import TrainState, build_train_state
from flaxformer_lite.train.run_dir import RunDir

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class LoadedRun:
    """A run's model at one checkpoint.

    Attributes:
      model: the ``EncoderDecoder``, ``DecoderLM`` or ``Encoder``, in eval mode (no dropout).
      tokenizer: the run's tokenizer (``<run_dir>/tokenizer``).
      config: the ``TrainConfig`` saved with the checkpoint (``config.model`` built ``model``).
      step: the optimizer step of the checkpoint.
    """

    model: nnx.Module
    tokenizer: Tokenizer
    config: TrainConfig
    step: int


def load_run(
    run_dir: pathlib.Path | str,
    *,
    step: int | None = None,
    mesh: Mesh | None = None,
    devices: Sequence[jax.Device] | None = None,
    trust_code: bool = False,
) -> LoadedRun:
    """Restores the model of ``run_dir/checkpoints`` at ``step`` (default: the newest).

    The directory is only read: an unreadable checkpoint is reported (a warning naming it) and
    the previous one is tried, but never moved aside (a training run may be writing into it).

    Args:
      run_dir: a directory written by ``train.py``.
      step: the checkpoint to load; default the newest finished one.
      mesh: where the parameters go, laid out by the run's ``mesh.rules`` (e.g.
        ``parallel.make_mesh(1, 1, 4)``: heads and MLP units split over 4 devices); default one
        ``(data, fsdp, tensor)`` mesh of size 1 on the first local device.
      devices: instead of ``mesh``: the parameters whole on each of these devices (a ``data``
        mesh over them).
      trust_code: import the code the run's settings name by import path (``models.pieces``:
        a user's attention function, mixer, positions, norm or feed-forward block).

    Raises:
      FileNotFoundError: ``run_dir`` is not a directory, or has no checkpoints or tokenizer
        (the message names the path).
      ValueError: ``step`` has no checkpoint, or the checkpoint cannot be restored; both
        ``mesh`` and ``devices``, or an empty ``devices``; the run names code by import path
        and ``trust_code`` is False.
      TypeError: ``step`` not an int, ``mesh`` not a ``jax.sharding.Mesh``, ``devices`` not
        a sequence of ``jax.Device``s.
    """
    if step is not None and (isinstance(step, bool) or not isinstance(step, int | np.integer)):
        raise TypeError(f"load_run: step= must be an int (a checkpoint's step), got {step!r}")
    if mesh is not None and not isinstance(mesh, Mesh):
        raise TypeError(f"load_run: mesh= must be a jax.sharding.Mesh, got {mesh!r}")
    if devices is not None and (
        not isinstance(devices, Sequence)
        or isinstance(devices, str)
        or not all(isinstance(d, jax.Device) for d in devices)
    ):
        raise TypeError(f"load_run: devices= must be a list of jax.Device, got {devices!r}")
    if devices is not None:
        if mesh is not None:
            raise ValueError("load_run takes mesh= or devices=, not both")
        if not devices:
            raise ValueError("load_run: devices= is empty; give at least one device")
        mesh = parallel.make_mesh(len(devices), 1, 1, devices=devices)
    run = RunDir(run_dir)
    if not run.path.is_dir():
        raise FileNotFoundError(f"{run}: no such run directory")
    directory = run.checkpoints
    # Checked before opening: the Checkpointer would create a missing directory.
    if not directory.is_dir():
        raise FileNotFoundError(f"{directory}: no checkpoints directory; is {run} a run?")
    if mesh is None:
        mesh = parallel.make_mesh(1, 1, 1, devices=jax.local_devices()[:1])
    # keep/every only matter when saving, which this never does.
    with Checkpointer(directory, keep=1, async_save=False, read_only=True) as checkpointer:
        steps = checkpointer.all_steps()
        if not steps:
            raise FileNotFoundError(f"{directory}: no finished checkpoint")
        tokenizer = load_tokenizer(run.tokenizer)
        if step is not None and step not in steps:
            raise ValueError(f"{directory}: no checkpoint for step {step}; it has steps {steps}")
        candidates = [step] if step is not None else steps[::-1]
        for candidate in candidates:
            try:
                with trusted_code(trust_code):
                    graphdef, state, restored = _restore_model_state(checkpointer, candidate, mesh)
                break
            except CheckpointError as error:
                if step is not None:
                    others = [s for s in steps if s != step]
                    suffix = f"; other steps: {others}" if others else ""
                    raise ValueError(f"{error}{suffix}") from error
                if candidate == candidates[-1]:
                    raise ValueError(
                        f"none of the checkpoints in {directory} (steps {steps}) can be "
                        f"restored; the oldest: {error}"
                    ) from error
                logger.warning("%s; trying the previous one", error)
    model, _ = nnx.merge(graphdef, from_savable(restored.state, state))
    return LoadedRun(model, tokenizer, config_from_dict(restored.config), restored.step)


# What each model kind is called in messages.


def load_hf_checkpoint(
    directory: pathlib.Path | str,
    *,
    kinds: tuple[ModelKind, ...] = (ModelKind.DECODER, ModelKind.ENCODER_DECODER),
    who: str = "generate",
    adapter: pathlib.Path | str | None = None,
) -> tuple[nnx.Module, Tokenizer]:
    """The model (``interop.load_hf``, float32, eval mode) and tokenizer of a Hugging Face
    checkpoint directory, a model of one of ``kinds`` (what ``who`` needs), with the PEFT LoRA
    ``adapter`` of that base merged in (``interop.merge_peft``); the architecture and the
    tokenizer are checked first, so a model of another kind or a directory without a tokenizer
    fails before any weights are read (ValueError / FileNotFoundError naming the directory and
    the files)."""
    from flaxformer_lite.interop import family_of, load_hf
    from flaxformer_lite.interop.common import read_config

    hf_config = read_config(directory)
    architecture = family_of(hf_config).config_from_hf(hf_config)
    if architecture.kind not in kinds:  # before the tokenizer, whose errors would mislead
        needed = " or ".join(ModelKind(kind).words for kind in kinds)
        raise ValueError(
            f"{directory} holds {architecture.kind.words} "
            f"({', '.join(hf_config.get('architectures') or [str(hf_config.get('model_type'))])}); "
            f"{who} needs {needed}"
        )
    tokenizer = load_hf_tokenizer(directory)
    model, cfg = load_hf(directory)
    if adapter is not None:
        from flaxformer_lite.interop.peft import merge_peft

        merge_peft(model, cfg, adapter)
    if tokenizer.vocab_size > model.config.vocab_size:
        raise ValueError(
            f"{directory}: the tokenizer has {tokenizer.vocab_size} ids, the model "
            f"only {model.config.vocab_size} embedding rows"
        )
    return model, tokenizer


def load_decoder(
    *,
    run_dir: pathlib.Path | str | None = None,
    hf_dir: pathlib.Path | str | None = None,
    step: int | None = None,
    trust_code: bool = False,
    who: str = "scoring",
    adapter: pathlib.Path | str | None = None,
) -> tuple[nnx.Module, Tokenizer]:
    """A decoder LM and its tokenizer, from a run directory (its checkpoint at ``step``,
    default the newest; :func:`load_run`) or a Hugging Face checkpoint directory (with a PEFT
    LoRA ``adapter`` of it merged in), for ``who``.

    Raises:
      ValueError: neither or both directories, ``step`` with ``hf_dir``, a model that is not
        a decoder LM; as :func:`load_run` and :func:`load_hf_checkpoint`.
    """
    if (run_dir is None) == (hf_dir is None):
        raise ValueError(f"{who} takes a run directory or a Hugging Face directory, one of them")
    if hf_dir is not None:
        if step is not None:
            raise ValueError("a step applies to a run directory, not a Hugging Face directory")
        return load_hf_checkpoint(hf_dir, kinds=(ModelKind.DECODER,), who=who, adapter=adapter)
    if adapter is not None:
        raise ValueError("a PEFT adapter applies to a Hugging Face directory, not a run directory")
    loaded = load_run(run_dir, step=step, trust_code=trust_code)
    kind = loaded.config.model.kind
    if kind is not ModelKind.DECODER:
        raise ValueError(f"{run_dir} holds {kind.words}; {who} needs a decoder LM")
    return loaded.model, loaded.tokenizer


def _restore_model_state(checkpointer: Checkpointer, step: int, mesh: Mesh):
    """The eval graph, abstract state and restored checkpoint of ``step``, built from its config.

    Raises:
      CheckpointError: a part of the checkpoint cannot be read.
    """
    cfg = config_from_dict(checkpointer.restore_config(step))
    # The optimizer state is restored too (and dropped): the checkpoint holds one pytree, and
    # restoring a part of it would need orbax placeholders.
    built = restorable_state(cfg, mesh)
    restored = checkpointer.restore(restore_target(built.state), step=step)
    check_base(restored, base_record(cfg, built.state), checkpointer.directory)
    return built.eval_graphdef, built.state, restored


def restorable_state(cfg: TrainConfig, mesh: Mesh, initializers: dict | None = None) -> TrainState:
    """The train state a checkpoint of ``cfg`` restores into: abstract (shapes and shardings),
    or, for a LoRA run, whose checkpoints hold the adapters alone, made with its base in place
    (``init_from``'s weights, or the seed's); ``initializers`` as for
    :func:`~.program.build_train_state`."""
    if cfg.lora.rank is None:
        return build_train_state(cfg, mesh, abstract=True)
    built = build_train_state(cfg, mesh, abstract=False, initializers=initializers)
    if cfg.init_from is None:
        return built
    return dataclasses.replace(built, state=load_hf_weights(built.state, cfg.init_from))


def starting_state(
    cfg: TrainConfig, mesh: Mesh, resuming: bool, initializers: dict | None, log
) -> TrainState:
    """A run's train state before its first step: to restore its checkpoint into
    (:func:`restorable_state`), or created from the seed, with ``init_from``'s weights (and a
    LoRA run's ``lora.adapter``) in place; ``log`` says where they came from."""
    if resuming:
        return restorable_state(cfg, mesh, initializers)
    built = build_train_state(cfg, mesh, abstract=False, initializers=initializers)
    if cfg.init_from is None:
        return built
    state = load_hf_weights(built.state, cfg.init_from)
    log(f"initialized the model from {cfg.init_from}")
    if cfg.lora.adapter is not None:
        from flaxformer_lite.interop.peft import load_peft_adapters

        scale = lora_scale(cfg.lora.alpha, cfg.lora.rank, cfg.lora.rslora)
        state = load_peft_adapters(state, cfg.model, cfg.lora.adapter, scale)
        log(f"initialized the adapters from {cfg.lora.adapter}")
    return dataclasses.replace(built, state=state)


def load_hf_weights(state, path: pathlib.Path | str):
    """Writes the parameters of the Hugging Face checkpoint ``path`` (read by
    ``interop.load_hf``) into the model part ``state[0]`` of a created train state, each in the
    sharding and dtype of the array it replaces; the rest (optimizer moments, still zero, and
    RNG state) is kept. Returns ``state``.

    Raises:
      ValueError: the checkpoint's parameters do not have the model's names and shapes.
    """
    from flaxformer_lite.interop import load_hf

    hf_model, _ = load_hf(path)
    loaded = traverse_util.flatten_dict(nnx.to_pure_dict(nnx.state(hf_model, nnx.Param)))
    like = traverse_util.flatten_dict(nnx.to_pure_dict(base_part(state)))
    shapes = {k: tuple(v.shape) for k, v in loaded.items()}
    wanted = {k: tuple(v.shape) for k, v in like.items()}
    if shapes != wanted:
        differing = [
            f"{'.'.join(map(str, k))}: {shapes.get(k)} vs {wanted.get(k)}"
            for k in sorted(shapes.keys() | wanted.keys(), key=str)
            if shapes.get(k) != wanted.get(k)
        ]
        raise ValueError(
            f"{path}: the checkpoint's parameters do not fit the configured model "
            f"(checkpoint vs model): {'; '.join(differing[:3])}"
        )

    def place(name):
        value = np.asarray(loaded[name], like[name].dtype)
        return jax.make_array_from_callback(value.shape, like[name].sharding, lambda i: value[i])

    nnx.replace_by_pure_dict(state[0], traverse_util.unflatten_dict({k: place(k) for k in like}))
    return state


__all__ = [
    "LoadedRun",
    "load_hf_weights",
    "load_run",
    "restorable_state",
    "starting_state",
]
