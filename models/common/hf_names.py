"""Hugging Face's tensor names for the shared decoder, and the q/k RoPE permutation.

Every family here is saved by ``transformers`` under the same names (``model.embed_tokens``,
``model.layers.{i}.self_attn.q_proj``, ``mlp.gate_proj``, ``lm_head`` ...), so one adapter serves
them all; each family's own ``hf.py`` reads and writes its ``config.json``.

Meta's (and our) RoPE rotates interleaved pairs ``(x0, x1), (x2, x3), ...`` of each head; HF's
classes rotate halves ``(x0, x_{d/2}), ...``. Converting ``wq``/``wk`` therefore reorders the rows
*within each head* (per KV head for ``wk``, which matters with GQA), and with them the q/k biases
(Qwen2) and the per-head q/k norm weights (Qwen3, one head's worth of rows). Getting this wrong is
subtle: logits still look plausible (torchtitan measured KL 5.4e-6 instead of ~1e-13), so tests
compare logits against ``transformers`` at 1e-5.

``HFNames`` is this layout as the checkpoint layer's name adapter (``seedckpt.checkpoint.model``):
it maps names both ways, says which tensors' rows are permuted in groups (heads), and for a stored
tensor the model lacks, which ``config.json`` field likely left it out (``config_fields``). Errors
here are ``ValueError``s; the format that reads or writes the file names it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

_LAYER = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.wq.bias": "self_attn.q_proj.bias",
    "attention.wk.bias": "self_attn.k_proj.bias",
    "attention.wv.bias": "self_attn.v_proj.bias",
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_TOP = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_INV = {v: k for k, v in _LAYER.items()}
_TOP_INV = {v: k for k, v in _TOP.items()}
_OURS = re.compile(r"layers\.(\d+)\.(.+)")
_THEIRS = re.compile(r"model\.layers\.(\d+)\.(.+)")
# The config.json fields that count a layer's routed experts, by family (the reader names the one a file sets)
_EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts")


def _is_rope_cache(name: str) -> bool:
    """Older ``transformers`` saved RoPE's frequencies (``rotary_emb.inv_freq``): a cache computed
    from ``config.json``, not a weight, so leaving it out loses nothing."""
    return name.endswith("rotary_emb.inv_freq")


def to_hf_name(fqn: str) -> str:
    if fqn in _TOP:
        return _TOP[fqn]
    m = _OURS.fullmatch(fqn)
    if m and m.group(2) in _LAYER:
        return f"model.layers.{m.group(1)}.{_LAYER[m.group(2)]}"
    raise ValueError(f"{fqn} has no Hugging Face name")


def from_hf_name(name: str) -> str | None:
    """Our FQN for an HF tensor name; ``None`` for tensors we do not keep (RoPE caches)."""
    if name in _TOP_INV:
        return _TOP_INV[name]
    m = _THEIRS.fullmatch(name)
    if m and m.group(2) in _LAYER_INV:
        return f"layers.{m.group(1)}.{_LAYER_INV[m.group(2)]}"
    if _is_rope_cache(name):
        return None
    raise ValueError(f"unexpected tensor {name!r}: this model has no such tensor")


def heads_of(fqn: str, args) -> int | None:
    """How many groups (heads) the RoPE permutation reorders ``fqn``'s rows within, or None."""
    if fqn.endswith(("attention.wq.weight", "attention.wq.bias")):
        return args.n_heads
    if fqn.endswith(("attention.wk.weight", "attention.wk.bias")):
        return args.n_kv_heads
    if fqn.endswith(("attention.q_norm.weight", "attention.k_norm.weight")):
        return 1  # one head's dimensions: the same permutation as each head's rows
    return None


def permute_to_hf(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Interleaved-pair rows -> half-split rows, per head (a 1-D ``w``: its elements)."""
    return w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, -1).transpose(1, 2).reshape(w.shape)


def permute_from_hf(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Half-split rows -> interleaved-pair rows, per head (inverse of ``permute_to_hf``)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, -1).transpose(1, 2).reshape(w.shape)


def split_gate_up(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A fused ``experts.gate_up_proj`` (``[experts, 2 * ffn, dim]``, the gate's rows first, as
    Qwen3.5-MoE and Gemma 4 store it) -> our ``w1`` and ``w3`` (its halves on dim 1). Checked here,
    not left to the shapes' later comparison: ``chunk`` of an odd row count gives unequal halves,
    and the reader then names a mismatch rather than the layout."""
    if t.dim() != 3 or t.shape[1] % 2:
        raise ValueError("a fused gate_up_proj is [experts, 2 * intermediate size, hidden size], the gate's rows first")
    gate, up = t.chunk(2, dim=1)
    return gate, up


def join_gate_up(parts: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Our ``w1`` and ``w3`` -> the fused ``gate_up_proj`` (``split_gate_up``'s inverse)."""
    return torch.cat(parts, dim=1)


@dataclass(frozen=True)
class ExpertNames:
    """How an HF family names a layer's mixture of experts: ``model.layers.{i}.{block}.gate.weight``
    for the router and ``model.layers.{i}.{block}.experts.{e}.{name}.weight`` for expert ``e``'s
    slice of our grouped ``moe.experts.{w1,w2,w3}`` (``projections``: ours -> theirs)."""

    block: str
    projections: tuple[tuple[str, str], ...]

    def stored(self, layer: str, rest: str, count: int) -> list[str] | None:
        """HF's names of the ``count`` slices of our ``layers.{layer}.{rest}``, or None if not an expert weight."""
        theirs = dict(self.projections).get(rest.removeprefix("moe.experts."))
        if not rest.startswith("moe.experts.") or theirs is None:
            return None
        return [f"model.layers.{layer}.{self.block}.experts.{e}.{theirs}.weight" for e in range(count)]

    def router(self) -> tuple[str, str]:
        return "moe.router.gate.weight", f"{self.block}.gate.weight"

    def part(self, layer: str, rest: str) -> tuple[str, int] | None:
        """Our grouped tensor and expert index for HF's ``model.layers.{layer}.{rest}``, or None."""
        m = re.fullmatch(rf"{re.escape(self.block)}\.experts\.(\d+)\.(\w+)\.weight", rest)
        ours = {theirs: mine for mine, theirs in self.projections}.get(m.group(2)) if m else None
        return (f"layers.{layer}.moe.experts.{ours}", int(m.group(1))) if ours else None


class HFRowOrder:
    """A name adapter's row order where q/k rows are HF's (half-split RoPE per head) for a model of
    ``args`` (its head counts): HF's own files, and torchtitan's Qwen3, which rotates halves too."""

    def __init__(self, args):
        self.args = args

    def row_groups(self, fqn: str) -> int | None:
        """Rows of ``fqn`` are permuted within this many equal groups (its heads), or None."""
        return heads_of(fqn, self.args)

    def to_stored_rows(self, fqn: str, tensor: torch.Tensor) -> torch.Tensor:
        heads = heads_of(fqn, self.args)
        return permute_to_hf(tensor, heads) if heads else tensor

    def from_stored_rows(self, tensor: torch.Tensor, groups: int) -> torch.Tensor:
        """Whole groups of rows as stored -> ours."""
        return permute_from_hf(tensor, groups)


class HFNames(HFRowOrder):
    """The name adapter between our FQNs and HF's for one model (``args`` gives the head counts;
    ``experts``: how the family names its experts, for a mixture of experts)."""

    def __init__(self, args, experts: ExpertNames | None = None):
        super().__init__(args)
        self.experts = experts

    def to_stored(self, fqn: str) -> str:
        m = _OURS.fullmatch(fqn)
        if self.experts is not None and m:
            ours, theirs = self.experts.router()
            if m.group(2) == ours:
                return f"model.layers.{m.group(1)}.{theirs}"
        reason = self.unkept_unless_zero(fqn)
        if reason is not None:
            raise ValueError(reason)
        return to_hf_name(fqn)

    def unkept_unless_zero(self, fqn: str) -> str | None:
        """Why HF's layout cannot hold ``fqn`` unless it is zero, or None. Aux-loss-free balancing's
        expert bias: transformers' classes have none, and a zero bias routes as none does, so an
        export leaves a zero one out and refuses any other (the exported model would route differently)."""
        m = _OURS.fullmatch(fqn)
        if self.experts is None or not m or m.group(2) != "moe.expert_bias":
            return None
        return (
            f"{fqn} is aux-loss-free balancing's trained expert bias, which transformers' class for this model "
            "cannot hold (exported, the model would route differently): export to dcp or torchtitan, "
            "or train with --model.load_balance aux_loss"
        )

    def from_stored(self, name: str) -> str | tuple[str, int] | None:
        m = _THEIRS.fullmatch(name)
        if self.experts is not None and m:
            ours, theirs = self.experts.router()
            if m.group(2) == theirs:
                return f"layers.{m.group(1)}.{ours}"
            part = self.experts.part(m.group(1), m.group(2))
            if part is not None:
                return part
        return from_hf_name(name)

    def left_out(self, skipped: list[str]) -> tuple[list[str], str | None]:
        """Of the stored names ``from_stored`` gave None (``skipped``): those the model should hold
        (the reader refuses them), and a line naming what is left out on purpose (None: nothing to
        say). Here only RoPE caches are left out, silently: a family that leaves out more says why."""
        return [name for name in skipped if not _is_rope_cache(name)], None

    def config_fields(self, name: str) -> tuple[str, ...]:
        """The ``config.json`` fields that likely left out of the model a tensor its files store as
        ``name`` (the fix to name), most likely first; () when no field does: a layer past
        ``num_hidden_layers``, an expert past the experts a layer has."""
        m = _THEIRS.fullmatch(name)
        if m is None:
            return ()
        if int(m.group(1)) >= self.args.n_layers:
            return ("num_hidden_layers",)
        expert = self.experts.part(m.group(1), m.group(2)) if self.experts is not None else None
        return _EXPERT_COUNTS if expert is not None and expert[1] >= self.args.n_experts else ()

    def stacked_names(self, fqn: str, count: int) -> list[str] | None:
        """HF's names of the ``count`` dim-0 slices that store ``fqn`` one tensor each (an expert
        weight), or None: ``fqn`` is stored whole under ``to_stored(fqn)``."""
        m = _OURS.fullmatch(fqn)
        if self.experts is None or not m:
            return None
        return self.experts.stored(m.group(1), m.group(2), count)
