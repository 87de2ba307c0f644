"""What a model family provides: the one place generic code asks about a model.

Generic code (the seed writer, the stage builder, parallelism, fine-tuning, conversion, metrics)
never names a tensor. It asks the family -- how to build the model and initialize it, which
top-level modules belong to the first and last pipeline stage, which tensors follow the
vocabulary, which are tied, which linears OSFT trains by default, the FLOPs per token (of the
whole model, and of each part a pipeline stage can own), and how the model reads and writes
Hugging Face's layout. Adding a family is a folder under ``models/`` that fills one
``ModelFamily`` and a line in ``models.registry`` (``docs/model_families.md`` walks through it).
The families here share one decoder (``models.common``), which fills most hooks.

The contract a family's model keeps (torchtitan's pipeline-friendly shape):

* its transformer blocks are ``model.layers``, an ``nn.ModuleDict`` keyed ``"0".."n-1"``, so FQNs
  survive deleting the blocks a pipeline stage does not own;
* the modules named in ``first_stage`` / ``last_stage`` may be set to ``None`` and are then skipped,
  and ``forward`` is a plain loop over ``layers.values()``;
* constructors allocate and never initialize: each module's ``init_weights(init)`` initializes only
  its own parameters (the init recipe), ``init_buffers()`` recomputes non-persistent buffers;
* its args (a dataclass) have ``dim``, ``n_layers``, ``n_heads``, ``head_dim``, ``vocab_size``,
  ``max_seq_len``, ``tie_word_embeddings`` and ``to_dict`` / ``from_dict``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

BLOCKS = "layers"  # the attribute holding the transformer blocks, in every family


@dataclass(frozen=True)
class HFAdapter:
    """A family's Hugging Face layout: ``config.json`` both ways, tensor names and row order."""

    model_types: tuple[str, ...]  # config.json ``model_type`` values this family reads
    names: Callable[[Any], Any]  # args -> name adapter (``seedckpt.checkpoint.model.NameAdapter``)
    config: Callable[[Any, torch.dtype], dict]  # (args, dtype) -> config.json
    args_from_config: Callable[[dict], Any]  # config.json -> args (ValueError naming what is refused)


@dataclass(frozen=True)
class TensorParallelPlan:
    """How a family's model is split over tensor-parallel ranks."""

    apply: Callable[[nn.Module, Any, bool], None]  # (stage module, TP mesh, sequence_parallel), on ``meta``
    sizes: Callable[[Any], dict[str, int]]  # args -> {what: size}: the sizes the TP degree must divide
    splits: Callable[[str], bool]  # FQN -> whether TP splits it (the rest is whole on every TP rank)


@dataclass(frozen=True)
class LayerCosts:
    """Training FLOPs per token of each part of the model a pipeline stage can own: the modules
    before the blocks (``first``: the embedding, a lookup), each block, and the modules after them
    (``last``: the final norm and the output projection). The stage split balances these."""

    first: int
    blocks: tuple[int, ...]
    last: int


@dataclass(frozen=True)
class ModelFamily:
    name: str
    args: type  # the configuration dataclass
    model: Callable[[Any], nn.Module]  # ``model(args)``: built on ``meta`` under a device context
    flavors: Mapping[str, Any]  # released shapes by name, and ``debug``
    shape_fields: tuple[str, ...]  # the args fields that decide which tensors exist and their shapes
    tied_weights: Callable[[Any], dict[str, str]]  # args -> {FQN: FQN whose tensor it is}
    first_stage: tuple[str, ...]  # top-level modules before the blocks (the embedding)
    last_stage: tuple[str, ...]  # top-level modules after the blocks (final norm, output projection)
    vocab_fqns: tuple[str, ...]  # tensors with one row per vocabulary entry (embedding first)
    osft_targets: tuple[str, ...]  # the block linears OSFT trains by default, as name suffixes
    # (args, seq_len, parameters or None: count them) -> training FLOPs per token
    flops_per_token: Callable[[Any, int, int | None], int]
    # (args, seq_len) -> the FLOPs per token of the embedding, each block and the output (mixtures of
    # experts counted by the parameters a token uses): what the pipeline split balances
    layer_flops: Callable[[Any, int], LayerCosts]
    hf: HFAdapter
    # {tool: args -> name adapter}: other tools' names (args: the model's, None where nobody described it)
    renamings: Mapping[str, Callable[[Any], Any]] = field(default_factory=dict)
    tensor_parallel: TensorParallelPlan | None = None  # None: no tensor parallelism for this family
    # args -> runs of blocks a pipeline stage holds whole, ``(first, last, why)`` each (Gemma 4's layers
    # that reuse an earlier layer's keys and values, with that layer): the split keeps them together
    joined_layers: Callable[[Any], Sequence[tuple[int, int, str]]] | None = None

    def flavor_of(self, args) -> str | None:
        """The released flavor with these tensor shapes, if any."""
        return matching_flavor(self.flavors, self.shape_fields, args)

    def blocks(self, model: nn.Module) -> nn.ModuleDict:
        """The transformer blocks a stage holds (activation checkpointing, compile, FSDP wrap each)."""
        return getattr(model, BLOCKS)

    def prune(self, model: nn.Module, layers, is_first: bool, is_last: bool) -> nn.Module:
        """Keep the blocks ``layers`` and the top-level modules of the stage's end(s); the rest is
        deleted (blocks) or set to ``None`` (top-level modules), FQNs unchanged."""
        blocks = self.blocks(model)
        owned = {str(i) for i in layers}
        for name in [name for name in blocks if name not in owned]:
            del blocks[name]
        for name in (() if is_first else self.first_stage) + (() if is_last else self.last_stage):
            setattr(model, name, None)
        return model

    def position(self, fqn: str) -> tuple[int, int]:
        """Where ``fqn`` sits in the model's order: (0, 0) before the blocks, (1, i) in block ``i``,
        (2, 0) after them -- which pipeline stage owns it, and the order files list tensors in."""
        top, _, rest = fqn.partition(".")
        if top == BLOCKS:
            return 1, int(rest.split(".", 1)[0])
        return (0, 0) if top in self.first_stage else (2, 0)

    def stage_of(self, fqn: str, stage_of_layer: Mapping[int, int], num_stages: int) -> int:
        """The pipeline stage that owns ``fqn``."""
        where, layer = self.position(fqn)
        return stage_of_layer[layer] if where == 1 else 0 if where == 0 else num_stages - 1


def matching_flavor(flavors: Mapping[str, Any], shape_fields: tuple[str, ...], args) -> str | None:
    """The name of the flavor whose ``shape_fields`` all equal ``args``', if any."""
    return next(
        (name for name, flavor in flavors.items() if all(getattr(flavor, f) == getattr(args, f) for f in shape_fields)),
        None,
    )


def decoder_flops_per_token(
    model: Callable[[Any], nn.Module], args, seq_len: int, num_params: int | None = None
) -> int:
    """Training FLOPs per token of a decoder-only transformer, torchtitan's formula: 6·N for the
    weight matmuls forward and backward (N: the parameters, counted on ``meta``, so a tied matrix
    once), plus 12·H·Q·K per layer for attention's two K-long matmuls per head (H heads of dimension
    Q, K the keys a query attends to: ``attended_keys``). An untied embedding is a lookup, not a
    matmul, so counting it overcounts (about 6 % for Llama-3.1-8B at T = 2048); published MFU figures
    share the convention."""
    if num_params is None:  # the caller may know it already (a layout it built): no model built here
        with torch.device("meta"):
            num_params = sum(p.numel() for p in model(args).parameters())  # a shared parameter once
    keys = sum(attended_keys(args, layer, seq_len) for layer in range(args.n_layers))
    return 6 * num_params + 12 * args.n_heads * args.head_dim * keys


def attended_keys(args, layer: int, seq_len: int) -> int:
    """The keys a query of block ``layer`` is counted against: the whole sequence (T, torchtitan's
    count, causal masking not discounted), or a sliding-window layer's window where shorter
    (``DecoderOptions.window``). Counted over T, Mistral 7B v0.1 (every layer windowed at 4096) costs
    94.99 GFLOPs a token at 32768 tokens instead of 49.89, and gpt-oss-20B (every other layer at 128)
    34.79 at 8192 instead of 30.03: MFU overstated by 90 % and 16 %."""
    window = args.decoder_options.window(layer)
    return seq_len if window is None else min(window, seq_len)
