"""A mixture-of-experts feed-forward for the shared decoder: a router, grouped experts, balancing.

Three parts, each small (torchtitan's split):

* ``Router`` -- scores every token against every expert in float32, picks each token's ``top_k``
  experts and their weights (``MoEOptions.score_func``):

  - ``softmax`` (Qwen3-MoE, Mixtral) or ``sigmoid`` (DeepSeek-V3) scores; the experts with the
    highest scores are chosen, weighed by their scores, renormalized to sum to one when
    ``norm_topk_prob``;
  - ``softmax_topk`` (gpt-oss): the experts with the highest logits are chosen and weighed by a
    softmax over the chosen logits alone (the scores the auxiliary loss sees are the softmax over
    all experts).

  With ``n_group`` > 1 (DeepSeek's group-limited routing) the experts form ``n_group`` equal
  groups of consecutive experts; each group is ranked by the sum of its ``group_top`` best scores
  (V3's two, V2's one), and only the ``topk_group`` best groups' experts can be chosen. The
  weights are multiplied by ``route_scale`` (DeepSeek-V3's ``routed_scaling_factor``).
  ``router_bias`` gives the gate a bias (gpt-oss). Routing is dropless: every token reaches its
  ``top_k`` experts, no capacity factor. Ties are broken by expert index (stable sorts, groups
  too), so the same token picks the same experts whatever batch, micro-batch or rank it is
  computed in.
* ``GroupedExperts`` -- every expert's gated feed-forward as one 3-D tensor per projection, global
  shapes ``w1`` (gate) / ``w3`` (up) ``[experts, ffn, dim]`` and ``w2`` (down) ``[experts, dim,
  ffn]``, and with ``expert_bias_terms`` their biases ``b1`` / ``b3`` ``[experts, ffn]`` and ``b2``
  ``[experts, dim]``, so the experts an expert-parallel rank owns are one contiguous dim-0 slice of
  each. The activation (``activation``) is ``silu``: ``w2(silu(w1 x) * w3 x)``, or gpt-oss's
  ``clamped_swiglu``: the gate clamped above at ``swiglu_limit``, the up projection to
  ``+-swiglu_limit``, then ``(up + 1) * gate * sigmoid(swiglu_alpha * gate)``. Tokens arrive
  sorted by expert with per-expert counts; the three matmuls are ``torch._grouped_mm`` where it
  applies (CPU with 16-byte-aligned rows; CUDA bf16 on sm90+) and a loop over the experts
  elsewhere, tested equal.
* ``MoE`` -- routes, runs the experts, weighs and sums each token's ``top_k`` outputs, and adds
  the shared experts' output when ``n_shared_experts`` > 0 (DeepSeek-V3): one dense SwiGLU
  (``models.common.feed_forward``) of width ``n_shared_experts * ffn_dim`` (``shared_ffn_dim`` in
  place of ``ffn_dim`` where a shared expert has a width of its own) that every token runs,
  ``moe.shared_experts.{w1,w2,w3}`` (torchtitan's names). With ``shared_gate`` (Qwen3.5-MoE) each
  token's shared output is scaled by ``sigmoid(x . g)``, a learned gate of one output,
  ``moe.shared_experts.gate.weight`` ``[1, dim]`` (``GatedFeedForward``).

Init (``MoEOptions.init``): ``normal`` is HF's (every weight normal at ``init_std``; the experts'
biases zero, the router's bias normal). ``torchtitan`` is torchtitan 0.3's truncated normals:
the router's gate at 0.02, or with ``router_depth_init`` at the layer's depth-scaled std
(DeepSeek-V3, gpt-oss), its bias zero; the experts' ``w1`` at 0.02 and ``w2``/``w3`` at the
depth-scaled std, or with ``expert_depth_init`` every expert tensor, biases included, at the
depth-scaled std (gpt-oss); the shared experts as a dense feed-forward, their gate at 0.02 (as
``w1``; ``normal``: at ``init_std``). Each tensor is drawn whole in order, so an expert's slice is a
fixed range of its values.

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
  the scores (``softmax_topk`` too: the softmax over all experts, as torchtitan's gpt-oss adds it) to
  *choose* experts (never to weigh them), and moved
  before each optimizer step by ``bias_update_rate * sign(mean - count)`` from the step's counts
  over the whole global batch (``update_expert_bias``).
* ``none`` -- neither.

Every MoE layer records, per forward, the tokens each expert received and its auxiliary loss
(``routed``, cleared by the trainer each step) for the balance statistics a run reports and the
bias updates. Recording skips activation checkpointing's recomputation, which runs inside backward.

The layer compiles whole (``torch.compile(fullgraph=True)``, ``training.compile``): its
data-dependent sizes are tensors or unbacked sizes in the graph, never Python numbers -- counts by
``tally`` (``bincount``'s size depends on the values), the grouped GEMM by ``grouped_mm`` -- and a
compiled forward leaves the record to its caller (``MoE.record_routed``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from models.common.feed_forward import GATE_ACTIVATIONS, TRUNC_BOUND, FeedForward

SCORE_FUNCS = ("softmax", "sigmoid", "softmax_topk")
ACTIVATIONS = (*GATE_ACTIVATIONS, "clamped_swiglu")  # the gated ones: SwiGLU, GeGLU (Gemma 4)


@dataclass(frozen=True)
class MoEOptions:
    n_experts: int
    top_k: int
    ffn_dim: int  # each routed expert's hidden width
    score_func: Literal["softmax", "sigmoid", "softmax_topk"] = "softmax"
    norm_topk_prob: bool = True  # renormalize the chosen experts' scores to sum to one
    route_scale: float = 1.0  # multiplies the routing weights
    n_group: int = 1  # groups of consecutive experts (group-limited routing when > 1)
    topk_group: int = 1  # the groups whose experts can be chosen
    group_top: int = 2  # a group is ranked by the sum of its group_top best scores
    router_bias: bool = False  # a bias on the router's gate
    n_shared_experts: int = 0  # a dense SwiGLU of width n_shared_experts * ffn_dim beside the experts
    shared_ffn_dim: int | None = None  # a shared expert's width where not ffn_dim (Qwen3.5-MoE's own)
    shared_gate: bool = False  # the shared experts' output times sigmoid(x . gate), per token
    expert_bias_terms: bool = False  # biases on every expert's three projections
    activation: Literal["silu", "gelu_tanh", "clamped_swiglu"] = "silu"
    swiglu_alpha: float = 1.702  # clamped_swiglu: the sigmoid's slope
    swiglu_limit: float = 7.0  # clamped_swiglu: the clamp
    load_balance: Literal["aux_loss", "bias", "none"] = "aux_loss"
    aux_loss_coef: float = 0.001
    bias_update_rate: float = 0.001
    init: Literal["torchtitan", "normal"] = "torchtitan"
    init_std: float = 0.02  # ``normal``: the std of every weight
    router_depth_init: bool = False  # torchtitan: the gate at the layer's depth-scaled std, not 0.02
    expert_depth_init: bool = False  # torchtitan: every expert tensor at the depth-scaled std

    def __post_init__(self):
        """One line naming the field for a choice the block cannot run."""
        if self.score_func not in SCORE_FUNCS:
            raise ValueError(f"score_func = {self.score_func!r}; choose one of {', '.join(SCORE_FUNCS)}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation = {self.activation!r}; choose one of {', '.join(ACTIVATIONS)}")
        if self.n_group < 1 or self.n_experts % self.n_group:
            raise ValueError(f"n_group = {self.n_group} must be >= 1 and divide n_experts = {self.n_experts}")
        per_group = self.n_experts // self.n_group
        if self.n_group > 1 and not 1 <= self.group_top <= per_group:
            raise ValueError(
                f"n_group = {self.n_group} leaves {'one expert' if per_group == 1 else f'{per_group} experts'} per "
                f"group; a group is ranked by its group_top = {self.group_top} best experts, so use at most "
                "n_experts / group_top groups (and group_top >= 1)"
            )
        if not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"topk_group = {self.topk_group}; it must be between 1 and n_group = {self.n_group}")
        if self.top_k > self.topk_group * (self.n_experts // self.n_group):
            raise ValueError(
                f"top_k = {self.top_k} exceeds the experts of topk_group = {self.topk_group} groups "
                f"({self.topk_group * (self.n_experts // self.n_group)}); raise topk_group or lower top_k"
            )
        if self.n_shared_experts < 0:
            raise ValueError(f"n_shared_experts = {self.n_shared_experts}; it must be >= 0")
        if self.shared_gate and not self.shared_dim:
            raise ValueError("shared_gate gates the shared experts' output: set n_shared_experts >= 1")

    @property
    def shared_dim(self) -> int:
        """The shared experts' width together (0: none), the one dense SwiGLU they are."""
        return self.n_shared_experts * (self.ffn_dim if self.shared_ffn_dim is None else self.shared_ffn_dim)

    def expert_numel(self, dim: int) -> int:
        """The parameters of one routed expert."""
        return 3 * dim * self.ffn_dim + (2 * self.ffn_dim + dim if self.expert_bias_terms else 0)


def _trunc_normal(init, tensor: torch.Tensor, std: float) -> None:
    init.trunc_normal_(tensor, std=std, cutoff=TRUNC_BOUND / std)


class Router(nn.Module):
    def __init__(self, dim: int, options: MoEOptions, init_std: float = 0.02):
        """``init_std``: the layer's depth-scaled std (``router_depth_init``)."""
        super().__init__()
        self.options = options
        self.init_std = init_std
        self.gate = nn.Linear(dim, options.n_experts, bias=options.router_bias)

    def init_weights(self, init) -> None:
        if self.options.init == "normal":
            for p in self.gate.parameters():
                init.normal_(p, std=self.options.init_std)
            return
        _trunc_normal(init, self.gate.weight, self.init_std if self.options.router_depth_init else 0.02)
        if self.gate.bias is not None:
            init.zeros_(self.gate.bias)

    def forward(self, x: torch.Tensor, expert_bias: torch.Tensor | None = None):
        """``x`` (tokens, dim) -> (scores (tokens, experts) fp32, chosen experts (tokens, top_k),
        their routing weights (tokens, top_k) fp32)."""
        options = self.options
        bias = None if self.gate.bias is None else self.gate.bias.float()
        logits = F.linear(x.float(), self.gate.weight.float(), bias)
        scores = logits.sigmoid() if options.score_func == "sigmoid" else logits.softmax(-1)
        # softmax_topk chooses by the logits; a bias joins the softmax scores instead (torchtitan's gpt-oss)
        ranked = logits if options.score_func == "softmax_topk" and expert_bias is None else scores
        chosen = self._choose(ranked if expert_bias is None else ranked + expert_bias)
        if options.score_func == "softmax_topk":
            weights = logits.gather(-1, chosen).softmax(-1)
        else:
            weights = scores.gather(-1, chosen)
            if options.norm_topk_prob:
                weights = weights / weights.sum(-1, keepdim=True)
        return scores, chosen, weights * options.route_scale

    def _choose(self, ranked: torch.Tensor) -> torch.Tensor:
        """Each token's ``top_k`` experts by ``ranked`` (tokens, experts), within its ``topk_group``
        best groups. Stable descending sorts: equal values keep expert (group) order, so ties
        never depend on the layout."""
        options = self.options
        if options.n_group > 1:
            grouped = ranked.unflatten(-1, (options.n_group, -1))
            group_scores = grouped.sort(dim=-1, descending=True).values[..., : options.group_top].sum(-1)
            kept = group_scores.sort(dim=-1, descending=True, stable=True).indices[:, : options.topk_group]
            dropped = torch.ones_like(group_scores, dtype=torch.bool).scatter_(1, kept, False)
            ranked = grouped.masked_fill(dropped[..., None], -math.inf).flatten(1)
        return ranked.sort(dim=-1, descending=True, stable=True).indices[:, : options.top_k]


def grouped_mm_applies(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` runs these operands (measured on torch 2.13): on the CPU float32,
    bfloat16 or float16 (float64 is refused) with every row 16-byte aligned (its backward refuses
    other strides); on CUDA bf16 on sm90 or newer, with the same alignment."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    aligned = all(
        w.shape[-1] * w.element_size() % 16 == 0 and w.shape[-2] * w.element_size() % 16 == 0 for w in weights
    )
    if x.device.type == "cpu":
        return aligned and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
    if x.device.type == "cuda":
        return aligned and x.dtype == torch.bfloat16 and _sm90_or_newer(x.device.index)
    return False


def _sm90_or_newer(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


# A compiled block reads it as a constant (dynamo would put the query in its graph, asked at every
# call): the mark ``torch.compiler.assume_constant_result`` sets, set without that decorator's
# import of torch._dynamo, 0.7 s of a seed's start-up (tests/test_startup.py checks both)
_sm90_or_newer._dynamo_marked_constant = True


class GroupedExperts(nn.Module):
    """``n_experts`` gated experts, ``w2(act(w1 x, w3 x))`` each (biases optional), as 3-D tensors."""

    def __init__(self, dim: int, options: MoEOptions, init_std: float):
        super().__init__()
        self.options = options
        self.init_std = init_std
        experts, ffn = options.n_experts, options.ffn_dim
        self.w1 = nn.Parameter(torch.empty(experts, ffn, dim))
        self.w2 = nn.Parameter(torch.empty(experts, dim, ffn))
        self.w3 = nn.Parameter(torch.empty(experts, ffn, dim))
        if options.expert_bias_terms:
            self.b1 = nn.Parameter(torch.empty(experts, ffn))
            self.b2 = nn.Parameter(torch.empty(experts, dim))
            self.b3 = nn.Parameter(torch.empty(experts, ffn))
        self.use_grouped_mm = True  # False: the per-expert loop (tests compare the two)

    def biases(self) -> list[torch.Tensor]:
        return [self.b1, self.b2, self.b3] if self.options.expert_bias_terms else []

    def init_weights(self, init) -> None:
        """Per tensor, like the dense feed-forward's ``w1``/``w2``/``w3``: each expert's slice is a
        fixed range of the tensor's values, so a rank drawing only its experts draws those values."""
        if self.options.init == "normal":
            for w in (self.w1, self.w2, self.w3):
                init.normal_(w, std=self.options.init_std)
            for b in self.biases():
                init.zeros_(b)
            return
        _trunc_normal(init, self.w1, self.init_std if self.options.expert_depth_init else 0.02)
        for w in (self.w2, self.w3, *self.biases()):
            _trunc_normal(init, w, self.init_std)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """``x`` (tokens, dim) sorted by expert, ``counts`` (experts,) tokens per expert -> (tokens, dim)."""
        return self.compute(x, counts, **dict(self.named_parameters()))

    def compute(self, x: torch.Tensor, counts: torch.Tensor, w1, w2, w3, b1=None, b2=None, b3=None) -> torch.Tensor:
        """``forward`` with the weights given: a parallel plan passes the block of experts it holds
        (``counts`` then counts the tokens of those experts only)."""
        if self.use_grouped_mm:
            operands = _in_autocast_dtype(x, w1, w2, w3, b1, b2, b3)
            if grouped_mm_applies(*operands[:3]):
                return self._grouped(counts, *operands)
        outputs = []
        for e, part in enumerate(x.split(counts.tolist())):
            gate, up = (F.linear(part, w[e], None if b is None else b[e]) for w, b in ((w1, b1), (w3, b3)))
            outputs.append(F.linear(self._activation(gate, up), w2[e], None if b2 is None else b2[e]))
        return torch.cat(outputs) if outputs else x[:0]

    def _grouped(self, counts: torch.Tensor, x, w1, w2, w3, b1, b2, b3) -> torch.Tensor:
        """``compute`` by three grouped GEMMs, the experts' rows told apart by ``counts``' offsets."""
        offsets = torch.cumsum(counts, 0, dtype=torch.int32)

        def project(h, w, b):
            out = grouped_mm(h, w.transpose(-2, -1), offsets)
            return out if b is None else out + b.repeat_interleave(counts, dim=0, output_size=h.shape[0])

        hidden = self._activation(project(x, w1, b1), project(x, w3, b3))
        return _ContiguousGradient.apply(project(hidden, w2, b2))

    def _activation(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.options.activation in GATE_ACTIVATIONS:
            return GATE_ACTIVATIONS[self.options.activation](gate) * up
        limit = self.options.swiglu_limit
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.options.swiglu_alpha))


def _in_autocast_dtype(*tensors: torch.Tensor | None) -> tuple:
    """``tensors`` in autocast's dtype where autocast is on (as ``F.linear``, the loop's matmul, takes
    them), else as given: under CUDA's bf16 autocast the float32 activations and weights reach the
    grouped GEMM, which runs bf16 only, instead of the per-expert loop."""
    device = tensors[0].device.type
    if not torch.is_autocast_enabled(device):
        return tensors
    dtype = torch.get_autocast_dtype(device)
    return tuple(None if t is None else t.to(dtype) for t in tensors)


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm(x, w, offs=offsets)``, compilable in every dtype: in torch 2.13 the
    op's fake kernel refuses all but bf16 operands, so other dtypes go through ``seedckpt::grouped_mm``
    (the same kernel in eager, with a fake kernel of any dtype and the op's own backward)."""
    if x.dtype == torch.bfloat16:
        return torch._grouped_mm(x, w, offs=offsets)
    return _any_dtype_grouped_mm(x, w, offsets)


@torch.library.custom_op("seedckpt::grouped_mm", mutates_args=())
def _any_dtype_grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``x`` (rows, k) grouped by ``offsets`` times ``w`` (groups, k, n) -> (rows, n); or, for the
    weights' gradient, ``x`` (k, rows) times ``w`` (rows, n), the rows grouped -> (groups, k, n)."""
    return torch._grouped_mm(x, w, offs=offsets)


@_any_dtype_grouped_mm.register_fake
def _(x, w, offsets):
    if w.dim() == 3:
        return x.new_empty(x.shape[0], w.shape[-1])
    return x.new_empty(offsets.shape[0], x.shape[0], w.shape[-1])


def _setup_grouped_mm_backward(ctx, inputs, output) -> None:
    x, w, offsets = inputs
    ctx.save_for_backward(x, w, offsets)


def _grouped_mm_backward(ctx, grad):
    """The forward's (rows, k) x (groups, k, n) form only; the gradient made contiguous (the CPU
    kernel refuses an expanded one)."""
    x, w, offsets = ctx.saved_tensors
    grad = grad.contiguous()
    grad_x = _any_dtype_grouped_mm(grad, w.transpose(-2, -1), offsets) if ctx.needs_input_grad[0] else None
    grad_w = _any_dtype_grouped_mm(x.transpose(0, 1), grad, offsets) if ctx.needs_input_grad[1] else None
    return grad_x, grad_w, None


_any_dtype_grouped_mm.register_autograd(_grouped_mm_backward, setup_context=_setup_grouped_mm_backward)


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


def sequence_balance_loss(scores: torch.Tensor, chosen: torch.Tensor, row_of_token: torch.Tensor, rows: int):
    """``sum over rows of E * sum_i f_i * P_i`` (see the module docstring) over the tokens routed:
    ``scores`` (tokens, experts), ``chosen`` (tokens, top_k), ``row_of_token`` (tokens,) the row each
    came from, of ``rows``. A row's statistics are over its own tokens (padding is not routed, so
    rows differ in length); a row without any adds nothing."""
    experts = scores.shape[-1]
    probs = scores / scores.sum(-1, keepdim=True)  # sigmoid scores: normalized per token first
    tokens = tally(row_of_token, rows).clamp(min=1).float()[:, None]
    slots = (row_of_token[:, None] * experts + chosen).flatten()  # (row, expert) of each choice
    picks = probs.new_zeros(rows * experts).index_add_(0, slots, probs.new_ones(slots.shape))
    picks = picks.view(rows, experts)
    mean_probs = torch.zeros_like(picks).index_add_(0, row_of_token, probs) / tokens
    return experts * (picks / tokens * mean_probs).sum()


def tally(values: torch.Tensor, bins: int) -> torch.Tensor:
    """``torch.bincount(values, minlength=bins)`` for ``values`` below ``bins``, with a size the
    compiler knows (bincount's depends on the largest value)."""
    return values.new_zeros(bins).index_add_(0, values, torch.ones_like(values))


def in_backward() -> bool:
    """Whether autograd's engine is running (activation checkpointing recomputing a forward)."""
    return torch._C._current_graph_task_id() != -1


class GatedFeedForward(FeedForward):
    """Shared experts whose output each token scales by ``sigmoid(gate(x))``, one learned logit
    (``MoEOptions.shared_gate``): the token decides how much of the shared path it takes."""

    def __init__(self, dim: int, hidden_dim: int, options: MoEOptions, init_std: float):
        super().__init__(dim, hidden_dim, options, init_std)
        self.gate = nn.Linear(dim, 1, bias=False)

    def init_weights(self, init) -> None:
        super().init_weights(init)  # this module's own w1, w2, w3 (leaves), not a child's init
        if self.options.init == "normal":
            init.normal_(self.gate.weight, std=self.options.init_std)
        else:
            _trunc_normal(init, self.gate.weight, 0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.gate(x)) * super().forward(x)


class MoE(nn.Module):
    def __init__(self, dim: int, options: MoEOptions, init_std: float):
        super().__init__()
        self.options = options
        self.router = Router(dim, options, init_std)
        self.experts = GroupedExperts(dim, options, init_std)
        shared = GatedFeedForward if options.shared_gate else FeedForward
        self.shared_experts = shared(dim, options.shared_dim, options, init_std) if options.shared_dim else None
        if options.load_balance == "bias":
            self.register_buffer("expert_bias", torch.empty(options.n_experts, dtype=torch.float32))
        else:
            self.expert_bias = None
        # Per forward since the trainer last cleared it: (tokens per expert, the auxiliary loss or None).
        self.routed: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        self.last_routed: tuple[torch.Tensor, torch.Tensor | None] | None = None  # the latest forward's
        # The auxiliary loss's weight in the gradient: aux_loss_coef over the rows and MoE layers
        # it is averaged over, in the training loss's scale. Set by the trainer; 0: not trained.
        self.aux_loss_scale = 0.0

    def init_weights(self, init) -> None:
        if self.expert_bias is not None:
            init.zeros_(self.expert_bias)

    def record_routed(self) -> None:
        """Keep the latest forward's record in ``routed``, unless activation checkpointing is
        recomputing that forward. Under ``torch.compile`` the forward leaves the call to whoever
        runs the compiled code (``apply_compile``), after its graph: whether autograd's engine is
        running is no value a graph can hold, and dynamo guards a list it appends to by length."""
        if not in_backward():
            self.routed.append(self.last_routed)

    def expert_inputs(self, flat: torch.Tensor) -> torch.Tensor:
        """The tokens ``flat`` as the experts take them: as routed (Gemma 4's experts norm them first)."""
        return flat

    def forward(self, x: torch.Tensor, owned: torch.Tensor | None = None) -> torch.Tensor:
        """``x`` (bsz, seq, dim); ``owned`` (bsz, seq) bool: the positions a document owns (None:
        all). Only those are routed: padding reaches no expert, counts in no statistic and adds
        nothing to the auxiliary loss -- its output is the shared experts' alone (no loss reads it)."""
        bsz, seqlen, dim = x.shape
        flat = x.reshape(-1, dim)
        if owned is None:
            token_ids = torch.arange(flat.shape[0], device=flat.device)
        else:
            token_ids = owned.flatten().nonzero().squeeze(1)
        scores, chosen, weights = self.router(flat[token_ids], self.expert_bias)
        counts = tally(chosen.flatten(), self.options.n_experts)
        order = chosen.flatten().argsort(stable=True)  # (token, choice) slots sorted by expert
        token_of_slot = token_ids[order // self.options.top_k]
        routed = self.experts(self.expert_inputs(flat)[token_of_slot], counts)
        routed = routed * weights.flatten()[order].to(routed.dtype)[:, None]
        out = torch.zeros_like(flat).index_add_(0, token_of_slot, routed.to(flat.dtype))
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        aux = None
        if self.options.load_balance == "aux_loss":
            aux = sequence_balance_loss(scores, chosen, token_ids // seqlen, bsz)
        self.last_routed = (counts.detach(), None if aux is None else aux.detach())
        if not torch.compiler.is_compiling():
            self.record_routed()
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
