"""torchtitan's checkpoints: DCP with torchtitan 0.3's names, an adapter over the ``dcp`` format.

Reading needs nothing here: the DCP reader maps every renaming the caller's codec knows for the
model (``codec.renamings``), so torchtitan's checkpoints open as ``dcp``. Writing uses torchtitan's
names, row order and the zero tensors its model has and ours may lack (a Qwen3-MoE's expert bias),
which its checkpointer loads as they are.
"""

from __future__ import annotations

from pathlib import Path

from seedckpt.checkpoint.base import OpenedCheckpoint, WriteJob
from seedckpt.checkpoint.formats import dcp
from seedckpt.utils.errors import SeedckptError

OUR_NAMES = False  # only the model's dense tensors have torchtitan names
TIED_STORED_ONCE = False  # torchtitan's model state holds lm_head.weight as its own entry
TOKENIZER_AT = dcp.TOKENIZER_AT  # written by dcp.write


def detect(path: Path) -> bool:
    """Never chosen by detection: a torchtitan checkpoint is DCP, read by ``dcp``."""
    return False


def write(source: OpenedCheckpoint, dst: Path, job: WriteJob) -> Path:
    names = (job.codec.renamings(source.layout) if job.codec is not None else {}).get("torchtitan")
    if names is None:
        raise SeedckptError("this model has no torchtitan names; convert --to dcp instead")
    return dcp.write(source, dst, job, names)
