"""Checkpoint I/O: the one reader and the one writer.

Every read (seed, stage load, resume, convert, inspect, diff) starts at ``open_checkpoint`` and
every write goes through ``write_checkpoint`` (or, for converted files, ``atomic_output``), so
validation, safety and crash-safety live in one place each. By responsibility:

* ``reader`` -- ``open_checkpoint(path)``: format detection, returns a ``base.Checkpoint``;
  ``dcp_reader``, ``files`` (HF directory, safetensors file, torch.save file) implement it.
* ``direct`` -- reading only the bytes a rank owns, straight into its tensors.
* ``load`` -- DCP load with checks, ``RowWindow`` (some rows of a checkpoint tensor).
* ``writer`` -- the streaming DCP writer (raw positions recorded), the lazy save planner.
* ``atomic`` -- one writer per destination (a lock), ``.NAME.<pid>.partial`` + rename publishing.
* ``integrity`` -- CRC32C checksums of every written byte, checked on every read.
* ``manifest`` -- ``seedckpt.json``, tensor tables, model-args checks, training-state names.
* ``safe_pickle`` / ``safetensors_header`` -- parsing untrusted metadata.
* ``steps`` -- a training run's ``step-N`` folders.
"""

from seedckpt.checkpoint.atomic import (PARTIAL_SUFFIX, atomic_output, check_destination, destination_lock,
                                       write_json_synced)
from seedckpt.checkpoint.base import Checkpoint
from seedckpt.checkpoint.dcp_reader import DcpCheckpoint
from seedckpt.checkpoint.load import RowWindow
from seedckpt.checkpoint.manifest import (MANIFEST_NAME, SHAPE_FIELDS, TOKENIZER_DIR, TensorInfo, dtype_name,
                                          is_model_key, make_manifest)
from seedckpt.checkpoint.reader import open_checkpoint
from seedckpt.checkpoint.safe_pickle import SafeFileSystemReader
from seedckpt.checkpoint.steps import complete_steps, prune_steps, step_dir
from seedckpt.checkpoint.writer import LazySavePlanner, StreamingFileSystemWriter, write_checkpoint

__all__ = ["PARTIAL_SUFFIX", "atomic_output", "check_destination", "destination_lock", "write_json_synced", "Checkpoint",
           "DcpCheckpoint", "RowWindow", "MANIFEST_NAME", "SHAPE_FIELDS", "TOKENIZER_DIR", "TensorInfo", "dtype_name",
           "is_model_key", "make_manifest", "open_checkpoint", "SafeFileSystemReader", "complete_steps",
           "prune_steps", "step_dir", "LazySavePlanner", "StreamingFileSystemWriter", "write_checkpoint"]
