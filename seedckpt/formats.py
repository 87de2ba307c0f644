"""Reading every supported checkpoint format tensor by tensor, in our FQNs and layout.

``open_source(path)`` detects the format and returns a ``Source`` whose ``infos`` map our flat
FQNs to shape/dtype and whose ``read(fqn)`` returns one whole tensor (q/k un-permuted for HF). Only
one tensor at a time is read, so conversion and diff stay within ~2 tensors of memory.

* ``dcp``: a DCP directory (``.metadata``), read through ``CheckpointReader``.
* ``hf``: a Hugging Face Llama directory: ``config.json`` + ``*.safetensors`` (+ index).
  Tied embeddings (no ``lm_head.weight``) give ``output.weight`` the embedding.
* ``safetensors``: one ``.safetensors`` file with our FQNs (what ``--to safetensors`` writes).
* ``torch``: a ``torch.save`` file of ``{fqn: tensor}`` (optionally under ``"model"``), read
  with ``weights_only=True`` and ``mmap=True``.

``open_checkpoint(path)`` is what stage building uses: a DCP ``CheckpointReader``, or for an HF
directory an ``HFCheckpointReader`` that loads through DCP's ``HuggingFaceStorageReader`` -- each
rank reads only its own tensors (and rows, for FSDP shards) -- with names mapped and q/k permuted.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch.distributed.checkpoint import HuggingFaceStorageReader

from models.llama import ModelArgs, Transformer
from seedckpt.checkpoint import (PARTIAL_SUFFIX, CheckpointReader, RowWindow, TensorInfo, check_args_match,
                                 is_model_key, load_state, tensor_problems)
from seedckpt.errors import SeedckptError
from seedckpt.hf import args_from_hf_config, from_hf_name, heads_of, permute_from_hf
from seedckpt.modules import local, local_rows

MANIFEST_KEY = "seedckpt_manifest"  # in safetensors metadata and torch.save files we write


def expected_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        return {fqn: tuple(t.shape) for fqn, t in Transformer(args).state_dict().items()}


class Source:
    kind = ""

    def __init__(self, path: Path, infos: dict[str, TensorInfo], args: ModelArgs | None, manifest: dict | None):
        self.path, self.infos, self.args, self.manifest = path, infos, args, manifest

    def read(self, fqn: str) -> torch.Tensor:
        raise NotImplementedError

    def require_args(self) -> ModelArgs:
        if self.args is None:
            raise SeedckptError(f"{self.path} does not record its model configuration; pass --config with the "
                                "config it was trained with")
        return self.args

    def check_against_args(self) -> None:
        """The tensors must be exactly the model that ``args`` describes."""
        if self.args is None:
            return
        want = expected_shapes(self.args)
        problems = [f"{f}: missing" for f in want if f not in self.infos]
        problems += [f"{f}: unexpected" for f in self.infos if f not in want]
        problems += [f"{f}: shape {list(i.shape)}, config implies {list(want[f])}"
                     for f, i in self.infos.items() if f in want and i.shape != want[f]]
        if problems:
            raise SeedckptError(f"{self.path}: weights do not match the model configuration: "
                                + "; ".join(problems[:10]) + (" ..." if len(problems) > 10 else ""))


class DcpSource(Source):
    kind = "dcp"

    def __init__(self, path: Path, args: ModelArgs | None):
        self.reader = CheckpointReader(path)
        infos = {f: i for f, i in self.reader.tensors().items() if is_model_key(f)}
        super().__init__(path, infos, self.reader.model_args() or args, self.reader.manifest)
        self.check_against_args()

    def read(self, fqn: str) -> torch.Tensor:
        return self.reader.read_tensor(fqn)


SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool}


def _safetensors_header(path: Path) -> tuple[dict, dict]:
    """(tensor entries, __metadata__) of a safetensors file, validating that the data is all there."""
    try:
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size))
        metadata = header.pop("__metadata__", None) or {}
        end = max((e["data_offsets"][1] for e in header.values()), default=0)
        unknown = {e["dtype"] for e in header.values()} - set(SAFETENSORS_DTYPES)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SeedckptError(f"{path} is not a valid safetensors file ({e})") from None
    if unknown:
        raise SeedckptError(f"{path} holds dtypes {sorted(unknown)} that seedckpt does not convert")
    if path.stat().st_size < 8 + size + end:
        raise SeedckptError(f"{path} is truncated: {path.stat().st_size} bytes, its header needs {8 + size + end}")
    return header, metadata


def _read_safetensor(path: Path, name: str) -> torch.Tensor:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return f.get_tensor(name)


class HFSource(Source):
    kind = "hf"

    def __init__(self, path: Path):
        try:
            self.config = json.loads((path / "config.json").read_text())
        except (OSError, ValueError) as e:
            raise SeedckptError(f"{path}/config.json cannot be read ({e})") from None
        try:
            args = args_from_hf_config(self.config)
        except (TypeError, ValueError, ZeroDivisionError) as e:
            raise SeedckptError(f"{path}/config.json describes no valid Llama model ({e})") from None
        index = path / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError, TypeError) as e:
                raise SeedckptError(f"{index} is not a valid safetensors index ({e!r})") from None
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in path.glob("*.safetensors"))
            weight_map = None
        self.location: dict[str, tuple[Path, str]] = {}  # our fqn -> (file, hf name)
        infos = {}
        for file in files:
            if not (path / file).is_file():
                raise SeedckptError(f"{index} lists {file}, which does not exist")
            header, _ = _safetensors_header(path / file)
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
        super().__init__(path, infos, args, None)
        self.check_against_args()

    def read(self, fqn: str) -> torch.Tensor:
        file, name = self.location[fqn]
        tensor = _read_safetensor(file, name)
        heads = heads_of(fqn, self.args)
        return permute_from_hf(tensor, heads) if heads else tensor


class SafetensorsSource(Source):
    kind = "safetensors"

    def __init__(self, path: Path, args: ModelArgs | None):
        header, metadata = _safetensors_header(path)
        if any(name.startswith("model.") or name == "lm_head.weight" for name in header):
            raise SeedckptError(f"{path} uses Hugging Face names; pass the directory that holds it and its "
                                "config.json")
        manifest, args = _embedded_manifest(metadata.get(MANIFEST_KEY), path, args)
        infos = {n: TensorInfo(tuple(e["shape"]), SAFETENSORS_DTYPES[e["dtype"]]) for n, e in header.items()}
        super().__init__(path, infos, args, manifest)
        self.check_against_args()

    def read(self, fqn: str) -> torch.Tensor:
        return _read_safetensor(self.path, fqn)


class TorchSource(Source):
    kind = "torch"

    def __init__(self, path: Path, args: ModelArgs | None):
        try:
            obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except Exception as e:  # torch raises many types for foreign or damaged files
            raise SeedckptError(f"{path} is not a supported checkpoint (DCP directory, HF directory, "
                                f".safetensors or torch.save file): {e}") from None
        if isinstance(obj, dict) and isinstance(obj.get("model"), dict):
            obj = obj["model"]
        if not isinstance(obj, dict):
            raise SeedckptError(f"{path} holds a {type(obj).__name__}, not a dict of tensors")
        manifest, args = _embedded_manifest(obj.get(MANIFEST_KEY), path, args)
        self.tensors = {k: v for k, v in obj.items() if isinstance(v, torch.Tensor)}
        infos = {k: TensorInfo(tuple(v.shape), v.dtype) for k, v in self.tensors.items()}
        super().__init__(path, infos, args, manifest)
        self.check_against_args()

    def read(self, fqn: str) -> torch.Tensor:
        return self.tensors[fqn].clone()  # out of the mmap: callers may keep it past the file


def _embedded_manifest(text, path: Path, args: ModelArgs | None) -> tuple[dict | None, ModelArgs | None]:
    """The manifest we embed in safetensors metadata / torch files, and the ModelArgs it records."""
    if not isinstance(text, str):
        return None, args
    try:
        manifest = json.loads(text)
        return manifest, ModelArgs.from_dict(manifest["model"]["args"])
    except (ValueError, KeyError, TypeError) as e:
        raise SeedckptError(f"{path}: its seedckpt manifest is damaged ({e!r})") from None


def open_source(path: str | Path, args: ModelArgs | None = None) -> Source:
    """Detect the format of ``path``; ``args`` describes the model when the checkpoint does not."""
    path = Path(path)
    if path.name.endswith(PARTIAL_SUFFIX):
        raise SeedckptError(f"{path} is an incomplete output of an interrupted write; delete it")
    if path.is_dir():
        if (path / ".metadata").is_file():
            return DcpSource(path, args)
        if (path / "config.json").is_file():
            return HFSource(path)
        raise SeedckptError(f"{path} is neither a DCP checkpoint (no .metadata) nor a Hugging Face "
                            "directory (no config.json)")
    if not path.is_file():
        raise SeedckptError(f"no checkpoint at {path}: give a DCP or Hugging Face directory, a .safetensors "
                            "file or a torch.save file")
    if path.suffix == ".safetensors":
        return SafetensorsSource(path, args)
    return TorchSource(path, args)


class HFCheckpointReader:
    """Stage loading straight from an HF directory, with the interface of ``CheckpointReader``."""

    def __init__(self, path: Path):
        self.path = path
        self.source = HFSource(path)

    def tensors(self) -> dict[str, TensorInfo]:
        return self.source.infos

    def check_model_args(self, args: ModelArgs, grow_vocab: bool = False) -> None:
        check_args_match(self.source.args, args, self.path, grow_vocab=grow_vocab)

    def load(self, state_dict: dict) -> None:
        """Fill ``state_dict`` (our FQNs) through DCP's ``HuggingFaceStorageReader``: each rank
        requests only its tensors and, for FSDP shards, its rows. ``wq``/``wk`` rows are permuted
        within each head, so a shard reads the whole heads around its rows and keeps its part.
        A tied output is read from the embedding. Lossless casts only (bf16 into fp32)."""
        problems = []
        for fqn, wanted in state_dict.items():
            info = self.source.infos.get(fqn)
            problems += [f"{fqn}: missing"] if info is None else tensor_problems(fqn, info, wanted)
        if problems:
            raise SeedckptError(f"{self.path} does not cover the model: " + "; ".join(problems))
        by_name, aliases, permuted = {}, [], []
        for fqn, wanted in state_dict.items():
            name = self.source.location[fqn][1]
            heads = heads_of(fqn, self.source.args)
            if name in by_name:  # a tied output beside its embedding: the same values
                if _dest(by_name[name]) is not _dest(wanted):
                    aliases.append((_dest(wanted), _dest(by_name[name])))
            elif heads:
                window = _whole_heads(wanted, heads)
                if window is not None:
                    by_name[name] = window
                    permuted.append((wanted, window, heads))
            else:
                by_name[name] = wanted
        load_state(by_name, HuggingFaceStorageReader(str(self.path)), self.path)
        with torch.no_grad():
            for wanted, window, heads in permuted:
                head_rows = wanted.shape[0] // heads
                rows = window.dest.shape[0]
                lo, hi = local_rows(wanted) or (0, wanted.shape[0])
                full = permute_from_hf(window.dest, rows // head_rows)
                local(wanted).copy_(full[lo - window.start:hi - window.start])
            for dst, src in aliases:
                dst.copy_(src)


def _dest(wanted) -> torch.Tensor:
    """The local storage a load destination writes into."""
    return wanted.dest if isinstance(wanted, RowWindow) else local(wanted)


def _whole_heads(wanted: torch.Tensor, heads: int) -> RowWindow | None:
    """A buffer for the whole RoPE heads that this rank's rows of ``wanted`` fall in (None: no rows)."""
    lo, hi = local_rows(wanted) or (0, wanted.shape[0])
    if hi <= lo:
        return None
    head_rows = wanted.shape[0] // heads
    first, last = lo // head_rows, -(-hi // head_rows)
    buffer = torch.empty(((last - first) * head_rows, *wanted.shape[1:]), dtype=wanted.dtype)
    return RowWindow(buffer, first * head_rows)


def open_checkpoint(path: str | Path) -> CheckpointReader | HFCheckpointReader:
    path = Path(path)
    if path.is_dir() and not (path / ".metadata").exists() and (path / "config.json").is_file():
        return HFCheckpointReader(path)
    return CheckpointReader(path)
