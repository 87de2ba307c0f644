"""``seedckpt.json``, the manifest beside every checkpoint we write, and the names it relies on.

The manifest records: format version, kind (seed | train | converted), model name, flavor and full
``ModelArgs``, seed, dtype, parameter count, per-tensor shape/dtype, torch and seedckpt versions,
and the byte position of every item's raw data (``raw_items``, see ``direct``). It is parsed here
and nowhere else.
"""

from __future__ import annotations

import datetime
import math
from dataclasses import dataclass
from pathlib import Path

import torch

import seedckpt
from models.llama import ModelArgs, Transformer
from seedckpt.checkpoint.untrusted import MAX_JSON_BYTES, parse_json, read_bounded
from seedckpt.errors import SeedckptError
from seedckpt.osft import OSFTSpec, convert_to_osft

MANIFEST_NAME = "seedckpt.json"
FORMAT_VERSION = 1
TOKENIZER_DIR = "tokenizer"  # a fine-tuning checkpoint's copy of its tokenizer files

# Training state beside the weights in a training checkpoint: these keys, and nothing else, are
# not model tensors (model tensors have flat FQNs).
OPTIMIZER_PREFIX = "optimizer."
TRAIN_STATE_KEY = "train_state"
RNG_PREFIX = "rng."
TRAINING_STATE_PREFIXES = (OPTIMIZER_PREFIX, TRAIN_STATE_KEY, RNG_PREFIX)

# ModelArgs fields that decide which tensors exist and their shapes: a config must agree with the
# checkpoint on these (loading an untied checkpoint into a tied model would keep one of two matrices).
SHAPE_FIELDS = ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "ffn_hidden_dim", "tie_word_embeddings")


@dataclass(frozen=True)
class TensorInfo:
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def is_model_key(fqn: str) -> bool:
    """Model tensors have flat FQNs; training state lives under the reserved prefixes."""
    return not fqn.startswith(TRAINING_STATE_PREFIXES)


def make_manifest(kind: str, model_name: str, flavor: str | None, args: ModelArgs, **extra) -> dict:
    """The manifest's fixed fields; the writer adds the per-tensor table from what it wrote."""
    return {
        "format_version": FORMAT_VERSION,
        "kind": kind,
        "model": {"name": model_name, "flavor": flavor, "args": args.to_dict()},
        "torch_version": torch.__version__,
        "seedckpt_version": seedckpt.__version__,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        **extra,
    }


def read_manifest(path: Path) -> dict | None:
    """The manifest of the checkpoint directory ``path``; ``None`` for a foreign checkpoint."""
    file = path / MANIFEST_NAME
    if not file.is_file():
        return None
    return parse_manifest(read_bounded(file, MAX_JSON_BYTES), file)


def parse_manifest(text: str | bytes, where) -> dict:
    """A manifest from its JSON text (a file of ours, or safetensors / torch.save metadata)."""
    manifest = parse_json(text, where, "the seedckpt manifest")
    if not isinstance(manifest, dict):
        raise SeedckptError(f"{where}: the seedckpt manifest is not a JSON object")
    return manifest


def manifest_args(manifest: dict | None, where) -> ModelArgs | None:
    """The ``ModelArgs`` a manifest records."""
    if manifest is None:
        return None
    try:
        return ModelArgs.from_dict(manifest["model"]["args"])
    except (KeyError, TypeError, ValueError) as e:
        raise SeedckptError(f"{where}: the seedckpt manifest is damaged ({e!r})") from None


def manifest_flavor(manifest: dict | None) -> str | None:
    model = (manifest or {}).get("model")
    return model.get("flavor") if isinstance(model, dict) else None


def check_args_match(saved: ModelArgs, args: ModelArgs, where, flavor: str | None = None,
                     grow_vocab: bool = False) -> None:
    """The tensor shapes that ``saved`` (from a checkpoint) and ``args`` (from a config) imply agree
    (with ``grow_vocab``, ``args`` may have more vocabulary rows than the checkpoint)."""
    diffs = [f"{f}: checkpoint {getattr(saved, f)!r}, config {getattr(args, f)!r}"
             for f in SHAPE_FIELDS if getattr(saved, f) != getattr(args, f)
             and not (f == "vocab_size" and grow_vocab and saved.vocab_size < args.vocab_size)]
    if diffs:
        made_with = f" (model.flavor={flavor!r})" if flavor else ""
        raise SeedckptError(f"config does not match checkpoint {where} ({'; '.join(diffs)}); use the config it "
                            f"was made with{made_with} or create a new seed for this config")


def expected_shapes(args: ModelArgs, osft: OSFTSpec | None = None) -> dict[str, tuple[int, ...]]:
    """The model tensors that ``args`` describes, by FQN (built on ``meta``: nothing allocated);
    with ``osft``, its targets hold SVD factors instead of a weight."""
    with torch.device("meta"):
        model = Transformer(args)
        if osft is not None:
            convert_to_osft(model, osft.patterns, osft.ratio)
        return {fqn: tuple(t.shape) for fqn, t in model.state_dict().items()}


def osft_record(spec: OSFTSpec) -> dict:
    """The OSFT settings as a manifest's ``finetune`` entry records them (read by ``manifest_osft``)."""
    return {"osft_unfreeze_rank_ratio": spec.ratio, "osft_target_patterns": list(spec.patterns)}


def manifest_osft(manifest: dict | None) -> OSFTSpec | None:
    """The OSFT settings an OSFT run's checkpoint was trained with (its factors' shapes follow)."""
    finetune = (manifest or {}).get("finetune")
    if not isinstance(finetune, dict) or finetune.get("mode") != "osft":
        return None
    try:
        return OSFTSpec(float(finetune["osft_unfreeze_rank_ratio"]), tuple(finetune["osft_target_patterns"]))
    except (KeyError, TypeError, ValueError) as e:
        raise SeedckptError(f"the manifest's OSFT settings are damaged ({e!r})") from None
