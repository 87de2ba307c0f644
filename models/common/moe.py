"""A mixture-of-experts feed-forward for the shared decoder: a router, grouped experts, balancing.

Three parts, each small (torchtitan's split):

* ``Router`` -- scores every token against every expert in float32 (softmax or sigmoid), picks
  each token's ``top_k`` experts and their weights. Routing is dropless: every token reaches its
  ``top_k`` experts, no capacity factor. Ties are broken by expert index (a stable sort), so the
  same token picks the same experts whatever batch, micro-batch or rank it is computed in.
* ``GroupedExperts`` -- every expert's SwiGLU weights as one 3-D tensor per projection, global
  shapes ``w1``/``w3`` ``[experts, ffn, dim]`` and ``w2`` ``[experts, dim, ffn]``, so the experts an
  expert-parallel rank owns are one contiguous dim-0 slice of each. Tokens arrive sorted by expert
  with per-expert counts; the three matmuls are ``torch._grouped_mm`` where it applies (CPU with
  16-byte-aligned rows; CUDA bf16 on sm90+) and a loop over the experts elsewhere, tested equal.
* ``MoE`` -- routes, runs the experts, weighs and sums each token's ``top_k`` outputs.

Balancing (``MoEOptions.load_balance``):

* ``aux_loss`` -- the sequence-wise auxiliary loss: for each row of the batch and each MoE layer,
  ``E * sum_i f_i * P_i``, with ``f_i`` the share of the row's tokens that picked expert ``i``
  (over the ``top_k`` choices) and ``P_i`` the row's mean score of expert ``i``; the training loss
  adds ``aux_loss_coef`` times its mean over the rows of the global batch and the MoE layers. HF's
  ``load_balancing_loss_func`` is the same product over whatever tokens reach ``forward`` pooled
  across layers, so its value depends on how the batch is split into micro-batches and ranks;
  per row, the statistics are the same in every layout. Its gradient is added in backward at the
  layer that computes it (``_AddAuxGradient``), so it needs no path through the pipeline's output.
* ``bias`` -- aux-loss-free balancing (DeepSeek-V3): a persistent fp32 ``expert_bias`` is added to
  the scores to *choose* experts (never to weigh them), and moved before each optimizer step by
  ``bias_update_rate * sign(mean - count)`` from the step's counts over the whole global batch
  (``update_expert_bias``).
* ``none`` -- neither.

Every MoE layer records, per forward, the tokens each expert received and its auxiliary loss
(``routed``, cleared by the trainer each step) for the balance statistics a run reports and the
bias updates. Recording skips activation checkpointing's recomputation, which runs inside backward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

# Absolute bound of ``nn.init.trunc_normal_``'s defaults (a=-2, b=2), which torchtitan keeps.
TRUNC_BOUND = 2.0


@dataclass(frozen=True)
class MoEOptions:
    n_experts: int
    top_k: int
    ffn_dim: int  # each routed expert's hidden width
    score_func: Literal["softmax", "sigmoid"] = "softmax"
    norm_topk_prob: bool = True  # renormalize the chosen experts' scores to sum to one
    route_scale: float = 1.0  # multiplies the routing weights
    load_balance: Literal["aux_loss", "bias", "none"] = "aux_loss"
    aux_loss_coef: float = 0.001
    bias_update_rate: float = 0.001
    init: Literal["torchtitan", "normal"] = "torchtitan"
    init_std: float = 0.02  # ``normal``: the std of every weight


class Router(nn.Module):
    def __init__(self, dim: int, options: MoEOptions):
        super().__init__()
        self.options = options
        self.gate = nn.Linear(dim, options.n_experts, bias=False)

    def init_weights(self, init) -> None:
        std = self.options.init_std if self.options.init == "normal" else 0.02
        if self.options.init == "normal":
            init.normal_(self.gate.weight, std=std)
        else:
            init.trunc_normal_(self.gate.weight, std=std, cutoff=TRUNC_BOUND / std)

    def forward(self, x: torch.Tensor, expert_bias: torch.Tensor | None = None):
        """``x`` (tokens, dim) -> (scores (tokens, experts) fp32, chosen experts (tokens, top_k),
        their routing weights (tokens, top_k) fp32)."""
        logits = F.linear(x.float(), self.gate.weight.float())
        scores = logits.softmax(-1) if self.options.score_func == "softmax" else logits.sigmoid()
        ranked = scores if expert_bias is None else scores + expert_bias
        # A stable descending sort: equal scores keep expert order, so ties never depend on the layout.
        chosen = ranked.sort(dim=-1, descending=True, stable=True).indices[:, : self.options.top_k]
        weights = scores.gather(-1, chosen)
        if self.options.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        return scores, chosen, weights * self.options.route_scale


def grouped_mm_applies(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` runs these operands (measured on torch 2.13): on the CPU any
    float dtype with every row 16-byte aligned (its backward refuses other strides); on CUDA bf16
    on sm90 or newer, with the same alignment."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    aligned = all(
        w.shape[-1] * w.element_size() % 16 == 0 and w.shape[-2] * w.element_size() % 16 == 0 for w in weights
    )
    if x.device.type == "cpu":
        return aligned
    if x.device.type == "cuda":
        return aligned and x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device)[0] >= 9
    return False


class GroupedExperts(nn.Module):
    """``n_experts`` SwiGLU experts, ``w2(silu(w1 x) * w3 x)`` each, as three 3-D weights."""

    def __init__(self, dim: int, options: MoEOptions, init_std: float):
        super().__init__()
        self.options = options
        self.init_std = init_std
        experts, ffn = options.n_experts, options.ffn_dim
        self.w1 = nn.Parameter(torch.empty(experts, ffn, dim))
        self.w2 = nn.Parameter(torch.empty(experts, dim, ffn))
        self.w3 = nn.Parameter(torch.empty(experts, ffn, dim))
        self.use_grouped_mm = True  # False: the per-expert loop (tests compare the two)

    def init_weights(self, init) -> None:
        """Per tensor, like the dense feed-forward's ``w1``/``w2``/``w3``: each expert's slice is a
        fixed range of the tensor's values, so a rank drawing only its experts draws those values."""
        if self.options.init == "normal":
            for w in (self.w1, self.w2, self.w3):
                init.normal_(w, std=self.options.init_std)
            return
        init.trunc_normal_(self.w1, std=0.02, cutoff=TRUNC_BOUND / 0.02)
        for w in (self.w2, self.w3):
            init.trunc_normal_(w, std=self.init_std, cutoff=TRUNC_BOUND / self.init_std)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """``x`` (tokens, dim) sorted by expert, ``counts`` (experts,) tokens per expert -> (tokens, dim)."""
        return self.compute(x, counts, self.w1, self.w2, self.w3)

    def compute(self, x: torch.Tensor, counts: torch.Tensor, w1, w2, w3) -> torch.Tensor:
        """``forward`` with the weights given: a parallel plan passes the block of experts it holds
        (``counts`` then counts the tokens of those experts only)."""
        if self.use_grouped_mm and grouped_mm_applies(x, w1, w2):
            offsets = torch.cumsum(counts, 0, dtype=torch.int32)
            hidden = F.silu(torch._grouped_mm(x, w1.transpose(-2, -1), offs=offsets))
            hidden = hidden * torch._grouped_mm(x, w3.transpose(-2, -1), offs=offsets)
            return _ContiguousGradient.apply(torch._grouped_mm(hidden, w2.transpose(-2, -1), offs=offsets))
        outputs = []
        for e, part in enumerate(x.split(counts.tolist())):
            outputs.append(F.linear(F.silu(F.linear(part, w1[e])) * F.linear(part, w3[e]), w2[e]))
        return torch.cat(outputs) if outputs else x[:0]


class _ContiguousGradient(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous: ``_grouped_mm``'s backward
    refuses an expanded one ("Invalid strides/sizes", e.g. the gradient of ``.sum()``)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


class _AddAuxGradient(torch.autograd.Function):
    """Identity on ``out``; in backward, gives ``aux`` the gradient one (``aux`` is already scaled).
    The auxiliary loss then trains the router without being added to the model's output."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, torch.ones((), dtype=torch.float32, device=grad.device)


def sequence_balance_loss(scores: torch.Tensor, chosen: torch.Tensor, rows: int) -> torch.Tensor:
    """``sum over rows of E * sum_i f_i * P_i`` (see the module docstring); ``scores`` (tokens,
    experts) and ``chosen`` (tokens, top_k) of ``rows`` equal rows."""
    experts = scores.shape[-1]
    probs = scores / scores.sum(-1, keepdim=True)  # sigmoid scores: normalized per token first
    picks = torch.zeros(rows, experts, device=scores.device, dtype=torch.float32)
    picks.scatter_add_(1, chosen.reshape(rows, -1), torch.ones_like(chosen, dtype=torch.float32).reshape(rows, -1))
    share = picks / (chosen.shape[0] // rows)
    return experts * (share * probs.reshape(rows, -1, experts).mean(1)).sum()


def in_backward() -> bool:
    """Whether autograd's engine is running (activation checkpointing recomputing a forward)."""
    return torch._C._current_graph_task_id() != -1


class MoE(nn.Module):
    def __init__(self, dim: int, options: MoEOptions, init_std: float):
        super().__init__()
        self.options = options
        self.router = Router(dim, options)
        self.experts = GroupedExperts(dim, options, init_std)
        if options.load_balance == "bias":
            self.register_buffer("expert_bias", torch.empty(options.n_experts, dtype=torch.float32))
        else:
            self.expert_bias = None
        # Per forward since the trainer last cleared it: (tokens per expert, the auxiliary loss or None).
        self.routed: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        # The auxiliary loss's weight in the gradient: aux_loss_coef over the rows and MoE layers
        # it is averaged over, in the training loss's scale. Set by the trainer; 0: not trained.
        self.aux_loss_scale = 0.0

    def init_weights(self, init) -> None:
        if self.expert_bias is not None:
            init.zeros_(self.expert_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, seqlen, dim = x.shape
        flat = x.reshape(-1, dim)
        scores, chosen, weights = self.router(flat, self.expert_bias)
        counts = torch.bincount(chosen.flatten(), minlength=self.options.n_experts)
        order = chosen.flatten().argsort(stable=True)  # (token, choice) slots sorted by expert
        token_of_slot = order // self.options.top_k
        routed = self.experts(flat[token_of_slot], counts)
        routed = routed * weights.flatten()[order].to(routed.dtype)[:, None]
        out = torch.zeros_like(flat).index_add_(0, token_of_slot, routed.to(flat.dtype))
        aux = sequence_balance_loss(scores, chosen, bsz) if self.options.load_balance == "aux_loss" else None
        if not in_backward():
            self.routed.append((counts.detach(), None if aux is None else aux.detach()))
        if aux is not None and self.aux_loss_scale and torch.is_grad_enabled():
            out = _AddAuxGradient.apply(out, aux * self.aux_loss_scale)
        return out.view(bsz, seqlen, dim)


def moe_modules(model: nn.Module) -> list[MoE]:
    """The MoE layers a (stage) model holds."""
    return [m for m in model.modules() if isinstance(m, MoE)]


def update_expert_bias(layer: MoE, counts: torch.Tensor) -> None:
    """Aux-loss-free balancing's step: ``counts`` (experts,) the step's tokens per expert over the
    global batch. Under-loaded experts' bias rises, over-loaded ones' falls, by a fixed step, with
    the change centered so the bias does not drift as a whole."""
    with torch.no_grad():
        delta = layer.options.bias_update_rate * torch.sign(counts.float().mean() - counts.float())
        layer.expert_bias += (delta - delta.mean()).to(layer.expert_bias.dtype)


def balance_summary(counts: torch.Tensor) -> float:
    """max / mean tokens per expert of one layer's ``counts`` (1.0: perfectly balanced)."""
    mean = counts.float().mean()
    return float(counts.max() / mean) if mean > 0 else math.nan
