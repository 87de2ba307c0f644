"""Checkpoint formats, one module each, every one with a reader and a ``write(source, dst, job)``.

* ``dcp`` -- ours and foreign DCP checkpoints (other tools' names mapped through the caller's codec);
* ``torchtitan`` -- DCP in torchtitan 0.3's names: an adapter over ``dcp`` (written; read as ``dcp``);
* ``hf`` -- a Hugging Face model directory;
* ``safetensors_file`` -- one ``.safetensors`` file with our FQNs;
* ``torch_file`` -- a ``torch.save`` file.

Each module has ``detect(path)``, ``reader(path, codec, layout, verify)`` (its ``OpenedCheckpoint``) and
``write(source, dst, job)``. ``FORMATS`` maps each ``convert --to`` target to its module and
``open_checkpoint``, the one way into a checkpoint, asks each in turn. Each module also says whether
it stores any tensor under our FQNs (``OUR_NAMES``: OSFT factors fit), whether it stores a tied
matrix once (``TIED_STORED_ONCE``) and where it keeps the tokenizer files a checkpoint carries
(``TOKENIZER_AT``: a folder inside it, ``""`` for its top level, None for a single file, which has no place).
"""

from __future__ import annotations

from pathlib import Path

from seedckpt.checkpoint.atomic import refuse_partial
from seedckpt.checkpoint.base import OpenedCheckpoint
from seedckpt.checkpoint.formats import dcp, hf, safetensors_file, torch_file, torchtitan
from seedckpt.checkpoint.model import ModelCodec, ModelLayout
from seedckpt.utils.errors import SeedckptError

FORMATS = {"dcp": dcp, "hf": hf, "safetensors": safetensors_file, "torch": torch_file, "torchtitan": torchtitan}


def open_checkpoint(
    path: str | Path,
    codec: ModelCodec | None = None,
    layout: ModelLayout | None = None,
    complete: bool = True,
    verify: bool = True,
) -> OpenedCheckpoint:
    """Detect the format of ``path`` (DCP directory, HF directory, ``.safetensors`` file,
    ``torch.save`` file) and check its tensors against the model it records (read with the caller's
    ``codec``); ``layout`` describes the model when the checkpoint does not. ``complete=False``: a
    checkpoint may lack tensors (a stage loads only some; its load names what is missing).
    ``verify``: check the bytes read against the checksums the checkpoint records (ours do)."""
    path = Path(path)
    refuse_partial(path)
    found = next((module for module in FORMATS.values() if module.detect(path)), None)
    if found is not None:
        checkpoint = found.reader(path, codec, layout, verify)
    elif path.is_dir():
        raise SeedckptError(
            f"{path} is neither a DCP checkpoint (no .metadata; an interrupted write?) nor a "
            "Hugging Face directory (no config.json)"
        )
    else:
        raise SeedckptError(
            f"no checkpoint at {path}: give a DCP or Hugging Face directory, a .safetensors "
            "file or a torch.save file (create a seed with `seedckpt seed --config CONFIG "
            "--output DIR`)"
        )
    checkpoint.check_against_layout(complete)
    return checkpoint
