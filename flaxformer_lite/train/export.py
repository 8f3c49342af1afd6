"""A trained run as a Hugging Face directory that ``transformers`` loads offline as it is:

    exported = export_run("runs/default", "exports/default")   # the newest checkpoint (or step=N)
    # then, offline: transformers.AutoModelForCausalLM / AutoTokenizer
    #     .from_pretrained(exported.path, local_files_only=True)

The directory holds ``config.json`` and ``model.safetensors`` (``interop.save_hf``) with the
tokenizer's pad, bos and eos ids in ``config.json`` and ``generation_config.json``, and the run's
tokenizer as ``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json``
(:mod:`flaxformer_lite.data.tokenizer_export`). ``flaxformer-lite generate --hf-dir`` reads it too.
A run with LoRA adapters is written merged; with ``peft=True`` its adapters alone are written as
a PEFT adapter of its ``init_from`` model instead (``adapter_config.json``,
``adapter_model.safetensors``: ``peft.PeftModel.from_pretrained(base, path)``).
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import shutil

from flaxformer_lite.data import hf_tokenizer_files, owner, remove_stale_partials
from flaxformer_lite.interop.hf import refuse_user_pieces, save_hf, writable_family
from flaxformer_lite.interop.peft import save_peft
from flaxformer_lite.models.config import ModelKind
from flaxformer_lite.nn.lora import has_adapters
from flaxformer_lite.train.config import load_config, task_of
from flaxformer_lite.train.run_dir import RunDir
from flaxformer_lite.train.trained_run import load_run

# The transformers Auto class that loads each architecture save_hf writes.
AUTO_CLASSES = {
    "GPT2LMHeadModel": "AutoModelForCausalLM",
    "LlamaForCausalLM": "AutoModelForCausalLM",
    "BertForMaskedLM": "AutoModelForMaskedLM",
    "BertForSequenceClassification": "AutoModelForSequenceClassification",
    "MarianMTModel": "AutoModelForSeq2SeqLM",
}


@dataclasses.dataclass(frozen=True)
class Exported:
    """What :func:`export_run` wrote: the directory, the HF architecture and the class that
    loads it (a ``transformers`` Auto class, or ``PeftModel`` of ``peft`` for an adapter), the run's
    checkpoint step and tokenizer name, and what a user of the export should know (``notes``)."""

    path: pathlib.Path
    architecture: str
    auto_class: str
    step: int
    tokenizer: str
    notes: tuple[str, ...] = ()


def export_run(
    run_dir: pathlib.Path | str,
    out: pathlib.Path | str,
    *,
    step: int | None = None,
    trust_code: bool = False,
    peft: bool = False,
) -> Exported:
    """Writes the model of ``run_dir``'s checkpoint ``step`` (default the newest) and the run's
    tokenizer into the new directory ``out``.

    The files are written into a temporary directory beside ``out``, which is renamed to ``out``
    once complete: an export that fails leaves nothing behind.

    An ``out`` that is a symbolic link is followed: the export replaces the empty directory it
    points to, and the link is kept. ``trust_code``: as ``load_run``'s. ``peft``: write the
    run's LoRA adapters alone, as a PEFT adapter.

    Raises:
      FileExistsError: ``out`` exists and is not an empty directory.
      FileNotFoundError: ``run_dir`` is no run (as ``load_run``).
      ValueError: ``out`` is inside a run directory; the model has no Hugging Face
        counterpart (the AFT mixer, sparse attention, a layout none of GPT-2, Llama, BERT,
        Marian has: the message says which setting), or ``step`` has no checkpoint; ``peft``
        for a run without adapters.
    """
    out = pathlib.Path(out)
    if out.is_symlink():  # the directory meant is the one it points to
        out = out.resolve()
    # A directory inside a run would read as part of it (RUN/checkpoints/30 as a step).
    inside = next((p for p in out.resolve().parents if RunDir(p).is_run()), None)
    if inside is not None:
        raise ValueError(
            f"{out} is inside the run directory {inside}: an export there would read as part "
            "of the run; choose a directory outside it"
        )
    if out.exists() and not (out.is_dir() and not any(out.iterdir())):
        raise FileExistsError(
            f"{out} exists and is not an empty directory; export writes a new one"
        )
    saved_config = RunDir(run_dir).config
    if saved_config.is_file():  # a variant is refused before its code would be imported
        refuse_user_pieces(load_config(saved_config, []).model, f"export of {run_dir}")
    loaded = load_run(run_dir, step=step, trust_code=trust_code)
    model_config = loaded.config.model
    family = writable_family(model_config, who=f"export of {run_dir}")
    if peft and not has_adapters(loaded.model):
        raise ValueError(f"export of {run_dir}: the run has no LoRA adapters (lora.rank unset)")
    if peft and loaded.config.init_from is None:
        raise ValueError(
            f"export of {run_dir}: its adapters adapt a base made from seed={loaded.config.seed}, "
            "which no one else has: export the model merged (without --peft)"
        )
    tokenizer = loaded.tokenizer
    task = task_of(model_config)
    files = hf_tokenizer_files(tokenizer, task=task, max_length=model_config.max_length)
    special_ids = {"pad": tokenizer.pad_id, "bos": tokenizer.sos_id, "eos": tokenizer.eos_id}
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.parent / f".{out.name}.export-{owner()}"
    remove_stale_partials(staging)  # those of exports killed on this host (kill -9)
    staging.mkdir()  # with the umask's permissions, which the export keeps
    try:
        if peft:
            save_peft(loaded.model, model_config, staging, base=loaded.config.init_from)
        else:
            save_hf(loaded.model, model_config, staging, special_ids=special_ids)
            for name, content in files.items():
                (staging / name).write_bytes(content)
        if out.exists():  # empty, checked above
            out.rmdir()
        os.replace(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    architecture = family.config_to_hf(model_config)["architectures"][0]
    loader = "PeftModel" if peft else AUTO_CLASSES[architecture]
    notes = []
    if model_config.kind is ModelKind.DECODER and model_config.positions == "learned":
        notes.append(
            f"its position table has {model_config.max_length} rows: transformers' generate "
            f"fails past {model_config.max_length} tokens (an IndexError), where flaxformer-lite "
            "generate slides its window"
        )
    return Exported(out, architecture, loader, loaded.step, tokenizer.name, tuple(notes))


__all__ = ["AUTO_CLASSES", "Exported", "export_run"]
