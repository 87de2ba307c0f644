"""Checkpoint I/O: the one reader and the one writer, knowing no model.

Every read (seed, stage load, resume, convert, inspect, diff) starts at ``open_checkpoint`` and
every write goes through ``write_checkpoint`` (DCP) or a format's ``write`` (``atomic_output``), so
validation, safety and crash-safety live in one place each. What this layer knows of a model comes
from its caller (``model``: expected shapes, tied FQNs, name adapters). By responsibility:

* ``formats`` -- one module per format (DCP, torchtitan names over DCP, HF directory, one
  safetensors file, torch.save file), each with a reader and ``write``; ``open_checkpoint``.
* ``base`` -- ``OpenedCheckpoint``, what every reader offers; ``WriteJob``, what every writer takes.
* ``model`` -- ``ModelLayout`` and the codec / name-adapter protocols a caller implements.
* ``owned_reads`` -- reading only the bytes a rank owns, straight into its tensors.
* ``load`` -- DCP load with checks, ``RowWindow`` (some rows of a checkpoint tensor).
* ``writer`` -- the streaming DCP writer (raw positions recorded), the lazy save planner.
* ``background`` -- asynchronous saves: staging, the write in a background thread, one in flight.
* ``atomic`` -- one writer per destination (a lock), ``.NAME.<pid>.partial`` + rename publishing.
* ``integrity`` -- CRC32C checksums of every written byte, checked on every read.
* ``fingerprint`` -- a checkpoint's weights identified in a bounded read (a fine-tuning job's source).
* ``manifest`` -- ``seedckpt.json``, tensor tables, training-state names.
* ``safe_pickle`` / ``safetensors_header`` / ``untrusted`` -- parsing untrusted metadata.
* ``steps`` -- a training run's ``step-N`` folders.
"""

from seedckpt.checkpoint.atomic import (
    PARTIAL_SUFFIX,
    atomic_output,
    check_destination,
    destination_lock,
    write_json_synced,
)
from seedckpt.checkpoint.base import OpenedCheckpoint, WriteJob
from seedckpt.checkpoint.formats import FORMATS, open_checkpoint
from seedckpt.checkpoint.formats.dcp import DcpCheckpoint
from seedckpt.checkpoint.load import RowWindow
from seedckpt.checkpoint.manifest import (
    MANIFEST_NAME,
    TOKENIZER_DIR,
    TensorInfo,
    dtype_name,
    is_model_key,
    make_manifest,
)
from seedckpt.checkpoint.model import ModelLayout
from seedckpt.checkpoint.safe_pickle import SafeFileSystemReader
from seedckpt.checkpoint.steps import complete_steps, prune_steps, step_dir, step_dirs
from seedckpt.checkpoint.writer import LazySavePlanner, StreamingFileSystemWriter, write_checkpoint

__all__ = [
    "PARTIAL_SUFFIX",
    "atomic_output",
    "check_destination",
    "destination_lock",
    "write_json_synced",
    "OpenedCheckpoint",
    "WriteJob",
    "FORMATS",
    "open_checkpoint",
    "DcpCheckpoint",
    "RowWindow",
    "MANIFEST_NAME",
    "TOKENIZER_DIR",
    "TensorInfo",
    "dtype_name",
    "is_model_key",
    "make_manifest",
    "ModelLayout",
    "SafeFileSystemReader",
    "complete_steps",
    "prune_steps",
    "step_dir",
    "step_dirs",
    "LazySavePlanner",
    "StreamingFileSystemWriter",
    "write_checkpoint",
]
