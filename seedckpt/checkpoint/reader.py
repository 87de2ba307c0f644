"""``open_checkpoint``: the one way into a checkpoint, whatever its format."""

from __future__ import annotations

from pathlib import Path

from models.llama import ModelArgs
from seedckpt.checkpoint.atomic import PARTIAL_SUFFIX
from seedckpt.checkpoint.base import Checkpoint
from seedckpt.checkpoint.dcp_reader import DcpCheckpoint
from seedckpt.checkpoint.files import HFCheckpoint, SafetensorsFile, TorchFile
from seedckpt.errors import SeedckptError


def open_checkpoint(path: str | Path, args: ModelArgs | None = None, complete: bool = True,
                    verify: bool = True) -> Checkpoint:
    """Detect the format of ``path`` (DCP directory, HF directory, ``.safetensors`` file,
    ``torch.save`` file) and check its tensors against the model it records; ``args`` describes
    the model when the checkpoint does not. ``complete=False``: a checkpoint may lack tensors
    (a stage loads only some; its load names what is missing). ``verify``: check the bytes read
    against the checksums the checkpoint records (ours do since they were introduced)."""
    path = Path(path)
    if path.name.endswith(PARTIAL_SUFFIX):
        raise SeedckptError(f"{path} is an incomplete output of an interrupted write; delete it and write it again")
    if path.is_dir():
        if (path / ".metadata").is_file():
            checkpoint = DcpCheckpoint(path, args, verify)
        elif (path / "config.json").is_file():
            checkpoint = HFCheckpoint(path)
        else:
            raise SeedckptError(f"{path} is neither a DCP checkpoint (no .metadata; an interrupted write?) nor a "
                                "Hugging Face directory (no config.json)")
    elif path.is_file():
        checkpoint = SafetensorsFile(path, args) if path.suffix == ".safetensors" else TorchFile(path, args)
    else:
        raise SeedckptError(f"no checkpoint at {path}: give a DCP or Hugging Face directory, a .safetensors "
                            "file or a torch.save file (create a seed with `seedckpt seed --config CONFIG "
                            "--output DIR`)")
    checkpoint.check_against_args(complete)
    return checkpoint
