"""torchtitan 0.3.0's names for Qwen3.5 (``torchtitan.models.qwen3_5``, read from the installed
package), so its DCP checkpoints load as they are and ours can be written in them.

Its model state, as its checkpointer saves it (no ``model.`` prefix), against ours:

* every layer's token mixing is ``layers.{i}.attn.*`` where ours is ``attention.*``: in a
  full-attention layer ``attn.{wq,wk,wv,wo,q_norm,k_norm}``, in a Gated DeltaNet layer
  ``attn.{in_proj_z,in_proj_a,in_proj_b,out_proj,norm}.weight``, ``attn.A_log`` and ``attn.dt_bias``;
* a linear layer's q, k and v projections are three tensors, ``attn.in_proj_{q,k,v}.weight``
  (every q head, every k head, every value head: the rows of Hugging Face's ``in_proj_qkv``, cut),
  and so are their convolutions, ``attn.conv_{q,k,v}.weight`` ``[channels, 1, kernel]``, where ours
  are one ``in_proj_qkv`` and one ``conv1d`` grouped by key head: each a ``StoredSplit``, so a rank
  holding some of our rows reads only the stored rows they come from;
* ``lm_head.weight`` is our ``output.weight``. torchtitan ties no embedding (its 0.8B, 2B and 4B
  keep ``lm_head`` apart): a tied model of ours is written with a copy of its embedding, reads such a
  copy as the tie and refuses a distinct ``lm_head`` in one line, as every reader of a tied model
  does (``OpenedCheckpoint.refuse_distinct_tied``); ``tok_embeddings``, ``norm``,
  ``feed_forward.{w1,w2,w3}``, ``attention_norm`` and ``ffn_norm`` are ours;
* its vision encoder (``vision_encoder.*``, always built) is skipped with one line, as the vision
  tower of a Hugging Face directory is: this model is the text decoder.

Its attention rotates halves of each head's first ``rotary_dim`` channels (``MRoPE`` over
``CosSinRoPE``; text positions turn every section alike) and its ``wq`` holds each head's query then
its gate, as Hugging Face's does, so rows are permuted as ``models.qwen3_5.hf`` permutes them. Its
norms are ours: ``(1 + w)`` on the residual stream and q/k, ``w`` times the norm before the SiLU gate
in the linear layers. Its linear layers have no biases and its attention none, so a model with
``attention_bias`` has no torchtitan layout and is refused.

Measured against torchtitan 0.3.0 itself (its debugmodel cut to 512 tokens, random weights, FLA's
CUDA kernel replaced by a token-by-token gated delta rule on the CPU, one row of 80 positions, the
linear layers past our 64-position chunk): our logits within 5.7e-6 of its own (of magnitude 3.5),
each layer's token mixing within 4e-6.
"""

from __future__ import annotations

import re

import torch

from models.common.gated_deltanet import qkv_from_hf, qkv_to_hf
from models.qwen3_5.hf import QKV_ROWS, Qwen35Names
from seedckpt.utils.stored_parts import StoredSplit

_LAYER = re.compile(r"layers\.(\d+)\.(attention|attn)\.(.+)")
# ours after ``attention.`` -> torchtitan's three parts' names after ``attn.``, in HF's row order
_SPLIT = {
    "in_proj_qkv.weight": ("in_proj_q.weight", "in_proj_k.weight", "in_proj_v.weight"),
    "conv1d.weight": ("conv_q.weight", "conv_k.weight", "conv_v.weight"),
}
_SPLIT_OF = {theirs: ours for ours, parts in _SPLIT.items() for theirs in parts}
_VISION = "vision_encoder."


class Qwen35TorchtitanNames(Qwen35Names):
    """torchtitan 0.3's Qwen3.5 names as the checkpoint layer's name adapter, for a model of
    ``args`` (its heads order the permuted rows and cut the q/k/v parts)."""

    def to_stored(self, fqn: str) -> str:
        if fqn == "output.weight":
            return "lm_head.weight"
        m = _LAYER.fullmatch(fqn)
        if m is None or m.group(2) != "attention":
            return fqn
        if m.group(3).endswith(".bias"):
            raise ValueError(
                f"{fqn}: torchtitan's Qwen3.5 has no attention biases; "
                "convert a model with attention_bias = true --to dcp or hf instead"
            )
        part = _SPLIT.get(m.group(3), (m.group(3),))[0]
        return f"layers.{m.group(1)}.attn.{part}"

    def from_stored(self, name: str) -> str | StoredSplit | None:
        if name == "lm_head.weight":
            return "output.weight"
        if name.startswith(_VISION):
            return None  # ``left_out``
        m = _LAYER.fullmatch(name)
        if m is None or m.group(2) != "attn":
            return name
        layer, part = m.group(1), m.group(3)
        if part.endswith(".bias"):
            return None  # no torchtitan Qwen3.5 has one: ``left_out`` refuses it
        if part in _SPLIT_OF:
            return self._split(layer, _SPLIT_OF[part])
        return f"layers.{layer}.attention.{part}"

    def _split(self, layer: str, ours: str) -> StoredSplit:
        """Our ``ours`` of layer ``layer`` as torchtitan's three tensors: HF's rows, cut into q, k, v."""
        heads, head_dim = self.args.linear_num_key_heads, self.args.linear_key_head_dim
        key_rows = heads * head_dim
        keys = tuple(f"layers.{layer}.attn.{part}" for part in _SPLIT[ours])

        def join(parts: tuple[torch.Tensor, ...]) -> torch.Tensor:
            rows = [part.shape[0] for part in parts]
            if rows[:2] != [key_rows, key_rows] or rows[2] % heads:
                raise ValueError(
                    f"{', '.join(keys)} have {rows} rows, which this model's linear layers cannot hold "
                    f"({key_rows} q and k rows: linear_num_key_heads x linear_key_head_dim); "
                    "describe the model the checkpoint holds (--config)"
                )
            return qkv_from_hf(torch.cat(parts), heads, head_dim)

        def split(tensor: torch.Tensor) -> tuple[torch.Tensor, ...]:
            return qkv_to_hf(tensor, heads, head_dim).split([key_rows, key_rows, tensor.shape[0] - 2 * key_rows])

        return StoredSplit(f"layers.{layer}.attention.{ours}", keys, join, split)

    def left_out(self, skipped: list[str]) -> tuple[list[str], str | None]:
        """torchtitan's vision encoder is skipped with one line; nothing else is."""
        refused = [name for name in skipped if not name.startswith(_VISION)]
        vision = len(skipped) - len(refused)
        note = None
        if vision:
            note = (
                f"{vision} tensors of torchtitan's Qwen3.5 vision encoder (vision_encoder.*) are skipped: "
                "this model is its text decoder"
            )
        return refused, note

    def row_groups(self, fqn: str) -> int | None:
        """The RoPE rows as Hugging Face's; the q/k/v parts are put in order by their ``StoredSplit``."""
        return None if fqn.endswith(QKV_ROWS) else super().row_groups(fqn)

    def zero_filled(self) -> dict:
        return {}  # every tensor of torchtitan's decoder is one of ours
