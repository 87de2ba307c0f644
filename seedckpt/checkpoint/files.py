"""Checkpoints that are not DCP: Hugging Face Llama directories, one ``.safetensors`` file with our
names, a ``torch.save`` file.

* ``hf``: ``config.json`` + ``*.safetensors`` (+ index). HF names are mapped to ours and q/k are
  un-permuted (``seedckpt.hf``); a tied model (no ``lm_head.weight``) gives ``output.weight`` the
  embedding. ``load`` goes through DCP's ``HuggingFaceStorageReader`` (reading rows with
  ``direct.DirectHFReader``), so each rank reads only its tensors and rows.
* ``safetensors``: what ``convert --to safetensors`` writes; the manifest is in its metadata.
* ``torch``: ``{fqn: tensor}`` (optionally under ``"model"``), read with ``weights_only=True`` and
  ``mmap=True``.
"""

from __future__ import annotations

from pathlib import Path

import torch

from seedckpt.checkpoint.base import Checkpoint
from seedckpt.checkpoint.direct import DirectHFReader
from seedckpt.checkpoint.load import RowWindow, copy_shared, load_state, one_destination_per_source, tensor_problems
from seedckpt.checkpoint.manifest import TensorInfo, check_args_match, parse_manifest
from seedckpt.checkpoint.safetensors_header import SAFETENSORS_DTYPES, safetensors_header
from seedckpt.checkpoint.untrusted import read_json
from seedckpt.errors import SeedckptError
from seedckpt.hf import args_from_hf_config, from_hf_name, heads_of, permute_from_hf
from seedckpt.modules import local, local_rows

MANIFEST_KEY = "seedckpt_manifest"  # in safetensors metadata and torch.save files we write

def _read_safetensor(path: Path, name: str) -> torch.Tensor:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return f.get_tensor(name)


class HFCheckpoint(Checkpoint):
    kind = "hf"

    def __init__(self, path: Path):
        self.config = read_json(path / "config.json", "the model configuration")
        try:
            args = args_from_hf_config(self.config)
        except (TypeError, ValueError, ZeroDivisionError) as e:
            raise SeedckptError(f"{path}/config.json describes no valid Llama model ({e})") from None
        index = path / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = read_json(index, "the safetensors index")["weight_map"]
                files = sorted(set(weight_map.values()))
            except (KeyError, TypeError, AttributeError) as e:
                raise SeedckptError(f"{index} is not a valid safetensors index ({e!r})") from None
        else:
            files = sorted(p.name for p in path.glob("*.safetensors"))
            weight_map = None
        self.location: dict[str, tuple[Path, str]] = {}  # our fqn -> (file, hf name)
        infos = {}
        for file in files:
            if not isinstance(file, str) or Path(file).name != file or not (path / file).is_file():
                raise SeedckptError(f"{index} lists {file!r}, which is not a file in {path}")
            header, _, _ = safetensors_header(path / file)
            for name, entry in header.items():
                fqn = from_hf_name(name)
                if fqn is None:
                    continue
                self.location[fqn] = (path / file, name)
                infos[fqn] = TensorInfo(tuple(entry["shape"]), SAFETENSORS_DTYPES[entry["dtype"]])
        if weight_map is not None:
            absent = [n for n, f in weight_map.items() if from_hf_name(n) is not None
                      and self.location.get(from_hf_name(n), (None, None))[1] != n]
            if absent:
                raise SeedckptError(f"{index} lists tensors that its files do not contain: {absent[:5]}")
        tied = args.tie_word_embeddings or "output.weight" not in infos
        if tied and "tok_embeddings.weight" in infos:  # the output projection is the embedding
            self.location["output.weight"] = self.location["tok_embeddings.weight"]
            infos["output.weight"] = infos["tok_embeddings.weight"]
        super().__init__(path, infos, None, args)
        self.recorded_args = args  # config.json records the model
        if tied and "tok_embeddings.weight" in infos:
            self.aliases["output.weight"] = "tok_embeddings.weight"

    def check_model_args(self, args, grow_vocab: bool = False) -> None:
        check_args_match(self.args, args, self.path, grow_vocab=grow_vocab)

    def read_tensor(self, fqn: str) -> torch.Tensor:
        file, name = self.location[fqn]
        tensor = _read_safetensor(file, name)
        heads = heads_of(fqn, self.args)
        return permute_from_hf(tensor, heads) if heads else tensor

    def load(self, state_dict: dict) -> None:
        """Fill ``state_dict`` (our FQNs) through DCP's HF reader: each rank requests only its
        tensors and, for FSDP shards, its rows. ``wq``/``wk`` rows are permuted within each head, so
        a shard reads the whole heads around its rows and keeps its part. A tied output is read
        from the embedding. Lossless casts only (bf16 into fp32)."""
        problems = []
        for fqn, wanted in state_dict.items():
            info = self.infos.get(fqn)
            problems += [f"{fqn}: missing"] if info is None else tensor_problems(fqn, info, wanted)
        if problems:
            raise SeedckptError(f"{self.path} does not cover the model: " + "; ".join(problems))
        names, shared = one_destination_per_source(state_dict, lambda fqn: self.location[fqn][1])
        by_name, permuted = {}, []
        for name, wanted in names.items():
            heads = heads_of(from_hf_name(name), self.args)
            if heads:
                window = _whole_heads(wanted, heads)
                if window is not None:
                    by_name[name] = window
                    permuted.append((wanted, window, heads))
            else:
                by_name[name] = wanted
        load_state(by_name, DirectHFReader(self.path), self.path)
        with torch.no_grad():
            for wanted, window, heads in permuted:
                head_rows = wanted.shape[0] // heads
                rows = window.dest.shape[0]
                lo, hi = local_rows(wanted) or (0, wanted.shape[0])
                full = permute_from_hf(window.dest, rows // head_rows)
                local(wanted).copy_(full[lo - window.start:hi - window.start])
        copy_shared(state_dict, names, shared)


def _whole_heads(wanted: torch.Tensor, heads: int) -> RowWindow | None:
    """A buffer for the whole RoPE heads that this rank's rows of ``wanted`` fall in (None: no rows)."""
    lo, hi = local_rows(wanted) or (0, wanted.shape[0])
    if hi <= lo:
        return None
    head_rows = wanted.shape[0] // heads
    first, last = lo // head_rows, -(-hi // head_rows)
    buffer = torch.empty(((last - first) * head_rows, *wanted.shape[1:]), dtype=wanted.dtype)
    return RowWindow(buffer, first * head_rows)


class SafetensorsFile(Checkpoint):
    kind = "safetensors"

    def __init__(self, path: Path, args=None):
        header, metadata, _ = safetensors_header(path)
        if any(name.startswith("model.") or name == "lm_head.weight" for name in header):
            raise SeedckptError(f"{path} uses Hugging Face names; pass the directory that holds it and its "
                                "config.json")
        manifest = _embedded_manifest(metadata.get(MANIFEST_KEY), path)
        infos = {n: TensorInfo(tuple(e["shape"]), SAFETENSORS_DTYPES[e["dtype"]]) for n, e in header.items()}
        super().__init__(path, infos, manifest, args)

    def read_tensor(self, fqn: str) -> torch.Tensor:
        return _read_safetensor(self.path, fqn)


class TorchFile(Checkpoint):
    kind = "torch"

    def __init__(self, path: Path, args=None):
        try:
            obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except Exception as e:  # torch raises many types for foreign or damaged files
            raise SeedckptError(f"{path} is not a supported checkpoint (DCP directory, HF directory, "
                                f".safetensors or torch.save file): {e}") from None
        if isinstance(obj, dict) and isinstance(obj.get("model"), dict):
            obj = obj["model"]
        if not isinstance(obj, dict):
            raise SeedckptError(f"{path} holds a {type(obj).__name__}, not a dict of tensors")
        manifest = _embedded_manifest(obj.get(MANIFEST_KEY), path)
        self._tensors = {k: v for k, v in obj.items() if isinstance(v, torch.Tensor)}
        infos = {k: TensorInfo(tuple(v.shape), v.dtype) for k, v in self._tensors.items()}
        super().__init__(path, infos, manifest, args)

    def read_tensor(self, fqn: str) -> torch.Tensor:
        return self._tensors[fqn].clone()  # out of the mmap: callers may keep it past the file


def _embedded_manifest(text, path: Path) -> dict | None:
    """The manifest we embed in safetensors metadata / torch.save files."""
    return parse_manifest(text, path) if isinstance(text, str) else None
