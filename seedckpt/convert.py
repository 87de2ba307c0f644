"""``seedckpt convert`` and ``seedckpt diff``: any supported format to any other, one tensor at a time.

Targets:

* ``dcp``: a DCP checkpoint with our flat FQNs and a manifest (kind ``converted``), through the
  one streaming writer; ``torchtitan``: the same with torchtitan 0.3's names (``qkv_linear``,
  ``lm_head``), which its checkpointer loads as they are.
* ``hf``: ``model-0000k-of-0000n.safetensors`` shards of at most ``--max-shard-size``, HF names,
  q/k permuted for HF's RoPE, ``model.safetensors.index.json`` and a ``config.json`` that
  ``transformers`` loads as ``LlamaForCausalLM``. A tied model is written tied (no
  ``lm_head.weight``), and the tokenizer files a fine-tuning checkpoint carries are copied along.
* ``safetensors``: one file with our FQNs; the manifest goes into the safetensors metadata.
* ``torch``: ``torch.save`` of ``{fqn: tensor}`` plus the manifest. ``torch.save`` pickles one
  object, so this target holds the whole model in memory -- prefer safetensors for large models.

Why a safetensors writer of our own: ``safetensors.torch.save_file`` (and DCP's
``HuggingFaceStorageWriter``, which calls it per file) needs every tensor of a shard in memory at
once -- 5 GB per default shard. The format is an 8-byte length, a JSON header computable from
shapes alone, and raw bytes, so it is streamed here tensor by tensor. Reading uses ``safetensors``
itself (and DCP's ``HuggingFaceStorageReader`` for stage loading).

Peak memory stays near two tensors (the one being written and the next one being read).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from seedckpt.checkpoint import (TOKENIZER_DIR, Checkpoint, LazySavePlanner, TensorInfo, atomic_output, dtype_name,
                                 make_manifest, open_checkpoint, write_checkpoint, write_json_synced)
from seedckpt.checkpoint.files import MANIFEST_KEY, HFCheckpoint, TorchFile
from seedckpt.checkpoint.manifest import manifest_osft
from seedckpt.checkpoint.safetensors_header import SAFETENSORS_DTYPES, safetensors_header
from seedckpt.checkpoint.writer import start_writeback
from seedckpt.config import DTYPES
from seedckpt.errors import SeedckptError
from seedckpt.hf import flavor_of, hf_config, heads_of, permute_to_hf, to_hf_name
from seedckpt.osft import FROZEN, TRAINABLE
from seedckpt.progress import Progress
from seedckpt.torchtitan import to_torchtitan_name

TARGETS = ("dcp", "hf", "safetensors", "torch", "torchtitan")
_ST_NAMES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}


def parse_size(text: str) -> int:
    """``"5GB"`` -> 5e9, ``"500MiB"`` -> 500 * 2**20, ``"1000"`` -> 1000 bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B?\s*", text, re.IGNORECASE)
    if not m:
        raise SeedckptError(f"--max-shard-size {text!r} is not a size like 5GB or 500MiB")
    base = 1024 if m.group(3) else 1000
    return int(float(m.group(1)) * base ** " KMGT".index(m.group(2).upper() or " "))


def _ordered(fqns) -> list[str]:
    """Embedding, layers in numeric order, norm, output -- the order HF files and readers expect."""
    def key(fqn: str):
        parts = fqn.split(".")
        if parts[0] == "layers":
            return (1, int(parts[1]), fqn)
        return (0 if parts[0] == "tok_embeddings" else 2, 0, fqn)
    return sorted(fqns, key=key)


def write_safetensors(path: Path, infos: dict[str, TensorInfo], read, metadata: dict[str, str],
                      on_tensor=lambda nbytes: None) -> None:
    """Stream tensors into a safetensors file: the header first (from shapes), then each tensor's
    bytes as ``read(name)`` produces it, reading the next one while the current one is written."""
    header, offset = {}, 0
    for name, info in infos.items():
        header[name] = {"dtype": _ST_NAMES[info.dtype], "shape": list(info.shape),
                        "data_offsets": [offset, offset + info.nbytes]}
        offset += info.nbytes
    header["__metadata__"] = metadata
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data must start 8-byte aligned
    names = list(infos)
    with open(path, "wb") as f, ThreadPoolExecutor(1) as pool:
        f.write(len(blob).to_bytes(8, "little") + blob)
        pending = pool.submit(read, names[0]) if names else None
        for i, name in enumerate(names):
            tensor = pending.result()
            pending = pool.submit(read, names[i + 1]) if i + 1 < len(names) else None
            tensor = tensor.to(infos[name].dtype).contiguous()
            if tuple(tensor.shape) != infos[name].shape:
                raise SeedckptError(f"{name}: read shape {list(tensor.shape)}, expected {list(infos[name].shape)}")
            offset = f.tell()
            f.write(tensor.reshape(-1).view(torch.uint8).numpy().data)
            f.flush()
            start_writeback(f.fileno(), offset, infos[name].nbytes)
            on_tensor(infos[name].nbytes)
            del tensor
        f.flush()
        os.fsync(f.fileno())


class DenseOSFT(Checkpoint):
    """An OSFT run's checkpoint seen as the dense model it computes: each target's ``weight`` is
    U_high diag(S_high) V_high^T + U_low diag(S_low) V_low^T, rebuilt (in fp32, then stored in the
    factors' dtype) only when read -- one matrix at a time, as the converters stream."""

    def __init__(self, source: Checkpoint):
        self.source, self.kind = source, source.kind
        self.targets = {fqn.removesuffix(".U_high") for fqn in source.infos if fqn.endswith(".U_high")}
        infos = {}
        for fqn, info in source.infos.items():
            base, _, name = fqn.rpartition(".")
            if base not in self.targets:
                infos[fqn] = info
            elif name == "U_high":
                infos[f"{base}.weight"] = TensorInfo((info.shape[0], source.infos[f"{base}.V_high"].shape[0]),
                                                     info.dtype)
        super().__init__(source.path, infos, source.manifest, source.args)

    def read_tensor(self, fqn: str) -> torch.Tensor:
        base = fqn.removesuffix(".weight")
        if base not in self.targets:
            return self.source.read_tensor(fqn)
        f = {name: self.source.read_tensor(f"{base}.{name}").float() for name in FROZEN + TRAINABLE}
        dense = (f["U_high"] * f["S_high"]) @ f["V_high"].T + (f["U_low"] * f["S_low"]) @ f["V_low"].T
        return dense.to(self.infos[fqn].dtype)


def convert(src: str | Path, dst: str | Path, to: str, dtype: str | None = None, max_shard_size: str = "5GB",
            force: bool = False, progress: bool = True, args=None, dense: bool = False, verify: bool = True) -> Path:
    """Convert ``src`` (any supported format) into ``dst`` as ``to``; returns ``dst``. An OSFT run's
    checkpoint keeps its factors unless ``dense`` (or the target is ``hf`` / ``torchtitan``, which
    have no place for them): then each target becomes its dense weight, for the next task of a
    continual-learning sequence. ``verify``: check the bytes read against the source's checksums."""
    if to not in TARGETS:
        raise SeedckptError(f"--to {to!r}: choose one of {', '.join(TARGETS)}")
    if dtype is not None and dtype not in DTYPES:
        raise SeedckptError(f"--dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    shard_bytes = parse_size(max_shard_size)
    source = open_checkpoint(src, args, verify=verify)
    has_factors = manifest_osft(source.manifest) is not None
    keeps_factors = has_factors and not (dense or to in ("hf", "torchtitan"))
    if keeps_factors and dtype is not None:
        raise SeedckptError(f"{src} holds OSFT factors; casting them would break their orthonormality. Pass "
                            "--dense to write (and cast) the dense weights, or leave out --dtype")
    if has_factors and not keeps_factors:
        source = DenseOSFT(source)
    model_args = source.require_args()
    if not source.infos:
        raise SeedckptError(f"{src} holds no model tensors")
    cast = DTYPES[dtype] if dtype else None
    infos = {f: TensorInfo(source.infos[f].shape, cast or source.infos[f].dtype) for f in _ordered(source.infos)}
    if model_args.tie_word_embeddings and to in ("dcp", "hf"):
        # Stored once, as HF and our seeds store it; their readers give the output the embedding.
        infos.pop("output.weight", None)
    out_dtype = cast or next(iter(infos.values())).dtype
    bar = Progress(sum(i.nbytes for i in infos.values()), f"convert {source.kind}->{to}", enabled=progress)
    recorded = source.manifest or {}
    flavor = recorded.get("model", {}).get("flavor") or flavor_of(model_args)
    manifest = make_manifest("converted", "llama3", flavor, model_args, dtype=dtype_name(out_dtype),
                             seed=recorded.get("seed"), source={"format": source.kind, "path": str(src)},
                             **({"finetune": recorded["finetune"]} if keeps_factors else {}))
    try:
        if to in ("dcp", "torchtitan"):
            fqn_of = {to_torchtitan_name(f) if to == "torchtitan" else f: f for f in infos}

            def produce(key: str, start: int, stop: int) -> torch.Tensor:
                bar.update(infos[fqn_of[key]].nbytes)
                return source.read_tensor(fqn_of[key])[start:stop]
            state = {k: torch.empty(infos[f].shape, dtype=infos[f].dtype, device="meta") for k, f in fqn_of.items()}
            return write_checkpoint(dst, state, manifest, force=force, planner=LazySavePlanner(produce), lookahead=1)
        if to == "hf":
            return _write_hf(source, Path(dst), infos, out_dtype, shard_bytes, force, bar)
        if to == "safetensors":
            with atomic_output(dst, force, directory=False, check=safetensors_header) as partial:
                write_safetensors(partial, infos, source.read_tensor, {MANIFEST_KEY: json.dumps(manifest)}, bar.update)
            return Path(dst)
        # torch: one pickle, whole model; published once it reads back as one
        with atomic_output(dst, force, directory=False, check=TorchFile) as partial:
            state = {f: source.read_tensor(f).to(i.dtype) for f, i in infos.items()}
            bar.update(sum(i.nbytes for i in infos.values()))
            with open(partial, "wb") as f:
                torch.save({**state, MANIFEST_KEY: json.dumps(manifest)}, f)
                f.flush()
                os.fsync(f.fileno())
        return Path(dst)
    finally:
        bar.close()


def _write_hf(source: Checkpoint, dst: Path, infos: dict[str, TensorInfo], dtype: torch.dtype, shard_bytes: int,
              force: bool, bar: Progress) -> Path:
    args = source.args
    shards: list[list[str]] = [[]]
    size = 0
    for fqn, info in infos.items():
        if shards[-1] and size + info.nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(fqn)
        size += info.nbytes

    def read_hf_layout(hf_name: str) -> torch.Tensor:
        fqn = by_hf_name[hf_name]
        heads = heads_of(fqn, args)
        tensor = source.read_tensor(fqn)
        return permute_to_hf(tensor, heads) if heads else tensor

    by_hf_name = {to_hf_name(f): f for f in infos}
    weight_map = {}
    with atomic_output(dst, force, check=HFCheckpoint) as partial:  # published once it reads back
        for k, fqns in enumerate(shards, start=1):
            file = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
            write_safetensors(partial / file, {to_hf_name(f): infos[f] for f in fqns}, read_hf_layout,
                              {"format": "pt"}, bar.update)
            weight_map.update({to_hf_name(f): file for f in fqns})
        index = {"metadata": {"total_size": sum(i.nbytes for i in infos.values())}, "weight_map": weight_map}
        write_json_synced(partial / "model.safetensors.index.json", index)
        write_json_synced(partial / "config.json", hf_config(args, dtype))
        tokenizer = source.path / TOKENIZER_DIR if source.path.is_dir() else None
        if tokenizer is not None and tokenizer.is_dir():
            for file in tokenizer.iterdir():
                if file.is_file() and not file.is_symlink():
                    shutil.copyfile(file, partial / file.name)
    return dst


def diff(a: str | Path, b: str | Path, atol: float = 0.0, args=None, verify: bool = True) -> tuple[bool, list[str]]:
    """Compare two checkpoints of any formats tensor by tensor; ``(equal, report lines)``."""
    left, right = open_checkpoint(a, args, verify=verify), open_checkpoint(b, args, verify=verify)
    lines, equal = [], True
    for fqn in _ordered(set(left.infos) | set(right.infos)):
        if fqn not in right.infos or fqn not in left.infos:
            lines.append(f"{fqn}: only in {a if fqn in left.infos else b}")
            equal = False
            continue
        li, ri = left.infos[fqn], right.infos[fqn]
        if li.shape != ri.shape:
            lines.append(f"{fqn}: shape {list(li.shape)} vs {list(ri.shape)}")
            equal = False
            continue
        x, y = left.read_tensor(fqn).double(), right.read_tensor(fqn).double()
        both = ~(x.isnan() | y.isnan())
        delta = (x[both] - y[both]).abs().max().item() if both.any() else 0.0
        note = f" (dtype {dtype_name(li.dtype)} vs {dtype_name(ri.dtype)})" if li.dtype != ri.dtype else ""
        note += " (NaN in different places)" if bool((x.isnan() != y.isnan()).any()) else ""
        if delta > atol or note:
            equal = False
            lines.append(f"{fqn}: max |delta| {delta:.3g}{note}")
    lines.append(f"{'equal' if equal else 'different'}: {len(set(left.infos) | set(right.infos))} tensors compared"
                 f" ({left.kind} vs {right.kind}, atol {atol:g})")
    return equal, lines
