"""``Checkpoint``: what every reader offers, whatever the format.

One protocol for every command and the stage builder: the tensor table (our FQNs), the manifest
and model args, ``read_tensor`` (one whole tensor, for convert/diff) and ``load`` (a state dict in
place, each rank reading only what it asks for), plus the checks that run before anything is
allocated.
"""

from __future__ import annotations

from pathlib import Path

import torch

from models.llama import ModelArgs
from seedckpt.checkpoint.load import RowWindow, tensor_problems
from seedckpt.checkpoint.manifest import (TensorInfo, check_args_match, expected_shapes, is_model_key, manifest_osft,
                                          manifest_args, manifest_flavor)
from seedckpt.errors import SeedckptError
from seedckpt.modules import copy_full_into


class Checkpoint:
    """An opened checkpoint. ``infos``: its model tensors by our FQNs; ``args``: the model it
    records (or the one the caller described, for formats that record none)."""

    kind = ""
    checksums = None  # ``integrity.Checksums`` where the format records them (our DCP checkpoints)

    def __init__(self, path: Path, infos: dict[str, TensorInfo], manifest: dict | None,
                 args: ModelArgs | None = None):
        self.path, self.infos, self.manifest = path, infos, manifest
        self.recorded_args = manifest_args(manifest, path)
        self.args = self.recorded_args or args
        # FQNs that are not stored but read from another tensor: {fqn: source} (a tied output).
        self.aliases: dict[str, str] = {}

    def tensors(self) -> dict[str, TensorInfo]:
        """Every tensor entry (training state included where the format has it), by our FQNs."""
        return self.infos

    def read_tensor(self, fqn: str) -> torch.Tensor:
        """One whole tensor on CPU, read by this process alone (conversion, diff)."""
        raise NotImplementedError

    def load(self, state_dict: dict) -> None:
        """Fill ``state_dict`` (tensors, DTensors, ``RowWindow``s) in place. Formats without a
        distributed reader read each tensor whole and keep this rank's part."""
        self.check_covers(state_dict)
        with torch.no_grad():
            for fqn, wanted in state_dict.items():
                full = self.read_tensor(fqn)
                if isinstance(wanted, RowWindow):
                    wanted.dest.copy_(full[wanted.start:wanted.start + wanted.dest.shape[0]])
                else:
                    copy_full_into(wanted, full)

    def require_args(self) -> ModelArgs:
        if self.args is None:
            raise SeedckptError(f"{self.path} does not record its model configuration; pass --config with the "
                                "config it was trained with")
        return self.args

    def check_model_args(self, args: ModelArgs, grow_vocab: bool = False) -> None:
        """Fail (before any allocation) if ``args`` does not describe the checkpoint's model.
        A foreign checkpoint that records no model is checked tensor by tensor at load time."""
        if self.recorded_args is not None:
            check_args_match(self.recorded_args, args, self.path, manifest_flavor(self.manifest), grow_vocab)

    def check_against_args(self, complete: bool = True) -> None:
        """The tensors must be the model that ``args`` describes (a manifest that disagrees with the
        tensors beside it is not trusted); with ``complete``, all of it (conversion, diff), else
        what a stage does not need may be absent (``check_covers`` names what a load lacks)."""
        if self.args is None:
            return
        want = expected_shapes(self.args, manifest_osft(self.manifest))
        problems = [f"{f}: missing" for f in want if f not in self.infos and complete]
        problems += [f"{f}: shape {list(i.shape)}, config implies {list(want[f])}"
                     for f, i in self.infos.items() if f in want and i.shape != want[f]]
        problems = problems[:10] + (["..."] if len(problems) > 10 else [])
        unused = [f for f in self.infos if f not in want]  # loading would silently leave them out
        if unused:
            problems.append(f"it has {len(unused)} model tensors this model does not use, e.g. {', '.join(unused[:4])}")
        if problems:
            raise SeedckptError(f"{self.path}: weights do not match the model configuration: " + "; ".join(problems))

    def check_covers(self, wanted: dict) -> None:
        """Every wanted tensor is in the checkpoint with the same global shape and a dtype that loads
        losslessly; otherwise one error listing what is missing and what the checkpoint has instead."""
        have = self.tensors()
        problems = []
        for fqn, t in wanted.items():
            if not isinstance(t, (torch.Tensor, RowWindow)):
                if not self.has_entry(fqn):
                    problems.append(f"{fqn}: missing from checkpoint")
            elif fqn not in have:
                problems.append(f"{fqn}: missing from checkpoint")
            else:
                problems += tensor_problems(fqn, have[fqn], t)
        if problems:
            unwanted = sorted(k for k in set(have) - set(wanted) if is_model_key(k))
            if unwanted:
                problems.append(f"it has {len(unwanted)} model tensors this model does not use, e.g. "
                                f"{', '.join(unwanted[:4])}")
            raise SeedckptError(f"checkpoint {self.path} does not cover the model: " + "; ".join(problems))

    def has_entry(self, key: str) -> bool:
        """A non-tensor entry (training state) is present; only DCP checkpoints store them."""
        return False
