"""Where every parameter goes, computed on ``meta``: per stage and per rank, no tensor storage.

The full model is built on ``meta`` and each tensor is attributed to the stage that owns it, as the
model's family says: the embedding to the first stage, the final norm and output to the last, block
``i`` to the stage whose layers include ``i``. Under tensor parallelism a rank holds ``1/tp`` of
each tensor the family's plan splits and the whole of the others (the norms), before FSDP shards
what it holds over ``dp_shard``. ``meta`` holds no storage, even for 405B, but each layer's modules
are Python objects, about 35 KB a layer: the config refuses more than ``MAX_LAYERS`` layers, so a
plan stays within seconds and half a GB.

A mixture of experts' grouped expert weights (``[experts, ...]``) are whole on every TP rank and
sharded by FSDP2 along the experts: over ``dp_shard`` without expert parallelism; with it, each EP
rank holds ``experts / ep`` of them, FSDP-sharded over the ``dp_shard x tp / ep`` ranks that hold
the same ones. FSDP2 pads dim-0 shards to equal chunks, so a GPU holds the rows of the largest.

Parameters are what is trained; persistent buffers (DeepSeek-V3's ``expert_bias``, moved by the
balancing rule, not by the optimizer) are counted apart, as bytes: checkpoints hold them, AdamW keeps
no state for them and FSDP2 leaves them whole on every GPU of their stage.

Beside the bytes, each stage's and rank's training FLOPs per token (the family's ``layer_flops`` at
``training.seq_len``, what the pipeline split balances), and the imbalance of each: the largest
stage's (rank's) share over the mean, 1.0 when even. A pipeline step waits for its slowest stage.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from models.common.moe import moe_modules
from seedckpt.config.job_config import DTYPES, JobConfig
from seedckpt.config.resolve import ResolvedRun
from seedckpt.materialize.stages import indexable_sizes
from seedckpt.parallel.parallelize import ParallelDims
from seedckpt.parallel.pipeline import pipeline_split, stage_flops, stage_ids_for_rank
from seedckpt.utils.tensors import state_tensors

# fp32 parameter + fp32 gradient + two fp32 AdamW moments.
TRAIN_BYTES_PER_PARAM = 16
SHARDED_BY_MANUAL_FSDP = 12  # its fp32 master shard and the two moments; the rest is whole on every rank


@dataclass
class StagePlan:
    stage: int
    pp_rank: int
    layers: list[int]
    has_embeddings: bool
    has_output: bool
    flops_per_token: int  # training FLOPs per token of this stage's blocks and ends
    params: int
    param_bytes: int
    params_per_tp_rank: int  # = params without tensor parallelism
    expert_params: int  # of ``params``, the routed experts' (0 for a dense model)
    expert_params_per_gpu: int  # the experts' parameters on each GPU: EP's share, FSDP-sharded
    buffer_bytes: int  # persistent buffers, beside ``param_bytes``


@dataclass
class RankPlan:
    pp_rank: int
    stages: list[int]
    flops_per_token: int
    params: int
    param_bytes: int
    param_bytes_per_dp_shard: int  # on each GPU: the TP rank's part, sharded over dp_shard (experts: EP too)
    expert_bytes_per_gpu: int  # of param_bytes_per_dp_shard, the routed experts'
    train_state_bytes_per_gpu: int  # params + grads + AdamW moments per GPU (see train_state_bytes)
    buffer_bytes: int  # persistent buffers, whole on each GPU of the rank


def train_state_bytes(cfg: JobConfig, params: int, dp_shard: int, experts: tuple[int, int] = (0, 0)) -> int:
    """Parameters, gradients and AdamW moments per GPU. FSDP2 shards all of it: the dense
    parameters over ``dp_shard``; ``experts``: (the routed experts' among ``params``, those one GPU
    holds). Manual FSDP shards only the fp32 master copy and the moments over ``dp_shard``: the
    gathered parameters (in ``mixed_precision_param``) and the gradient buffer (in
    ``mixed_precision_reduce``) are whole on every rank."""
    if cfg.parallelism.fsdp_impl == "manual":
        train = cfg.training
        whole = DTYPES[train.mixed_precision_param].itemsize + DTYPES[train.mixed_precision_reduce].itemsize
        return params * whole + -(-params * SHARDED_BY_MANUAL_FSDP // dp_shard)
    return per_gpu(params, experts, dp_shard, TRAIN_BYTES_PER_PARAM)


def per_gpu(params: int, experts: tuple[int, int], dp_shard: int, unit: int) -> int:
    """Bytes on one GPU at ``unit`` bytes a parameter: the dense ones of ``params`` sharded over
    ``dp_shard``, and the ``experts`` (held, on one GPU) as EP and FSDP place them."""
    return -(-(params - experts[0]) * unit // dp_shard) + experts[1] * unit


def expert_rows_per_gpu(experts: int, dims: ParallelDims) -> int:
    """Of a grouped expert weight's ``experts`` rows, the most one GPU holds (module docstring)."""
    if dims.ep > 1:
        return -(-(experts // dims.ep) // dims.efsdp)
    return -(-experts // dims.dp_shard)


def expert_weights(model) -> set[str]:
    """The FQNs of the grouped expert weights of a (meta) model."""
    names = {id(m): name for name, m in model.named_modules()}
    return {
        f"{names[id(layer.experts)]}.{p}" for layer in moe_modules(model) for p, _ in layer.experts.named_parameters()
    }


def make_plan(run: ResolvedRun) -> dict:
    """Parameters and bytes per stage and per rank of a resolved run (validated like a training run)."""
    cfg, args, dims = run.cfg, run.args, run.dims
    par = cfg.parallelism
    pp, per_rank, dp_shard = dims.pp, par.pipeline_parallel_stages_per_rank, dims.dp_shard
    num_stages = pp * per_rank
    with indexable_sizes(args):  # the costs build the model on meta too
        costs = run.family.layer_flops(args, cfg.training.seq_len)
        with torch.device("meta"):
            model = run.family.model(args)
    layers = pipeline_split(args, num_stages, par.pipeline_parallel_split_points, costs=costs)
    flops = stage_flops(costs, layers)
    owner = {s: r for r in range(pp) for s in stage_ids_for_rank(r, pp, per_rank, par.pipeline_parallel_schedule)}
    stage_of_layer = {i: s for s, ids in enumerate(layers) for i in ids}
    grouped = expert_weights(model)
    sums = _stage_sums(run, model, grouped, stage_of_layer, num_stages)
    stages = [
        StagePlan(
            s, owner[s], list(layers[s]), s == 0, s == num_stages - 1, flops[s], **{k: v[s] for k, v in sums.items()}
        )
        for s in range(num_stages)
    ]
    ranks = [_rank_plan(cfg, r, [s for s in stages if s.pp_rank == r], dp_shard) for r in range(pp)]
    n_experts = next((model.get_parameter(fqn).shape[0] for fqn in sorted(grouped)), None)
    return {
        "model": cfg.model.name,
        "flavor": cfg.model.flavor,
        "args": args.to_dict(),
        "total_params": sum(sums["params"]),
        "total_bytes": sum(sums["param_bytes"]),  # of the parameters
        "buffer_bytes": sum(sums["buffer_bytes"]),  # persistent buffers (module docstring)
        "pipeline_parallel_degree": pp,
        "stages_per_rank": per_rank,
        "data_parallel_shard_degree": dp_shard,
        "data_parallel_replicate_degree": dims.dp_replicate,
        "tensor_parallel_degree": dims.tp,
        "expert_parallel_degree": dims.ep,
        "experts": n_experts,  # per MoE layer (None: a dense model)
        "experts_per_ep_rank": n_experts // dims.ep if n_experts else None,
        "expert_rows_per_gpu": expert_rows_per_gpu(n_experts, dims) if n_experts else None,
        "fsdp_impl": par.fsdp_impl,
        "seq_len": cfg.training.seq_len,  # attention's length in the FLOPs
        "imbalance": {  # max / mean: 1.0 is even
            "stage_flops": imbalance(flops),
            "stage_bytes": imbalance(sums["param_bytes"]),
            "rank_flops": imbalance([r.flops_per_token for r in ranks]),
            "rank_bytes_per_gpu": imbalance([r.param_bytes_per_dp_shard for r in ranks]),
        },
        "stages": [asdict(s) for s in stages],
        "ranks": [asdict(r) for r in ranks],
    }


def _stage_sums(run: ResolvedRun, model, grouped: set[str], stage_of_layer: dict, num_stages: int) -> dict:
    """Per stage, ``StagePlan``'s counts over the (meta) ``model``'s tensors, each tensor in the stage
    its family's ``stage_of`` names (``grouped``: the expert weights); a persistent buffer adds to
    ``buffer_bytes`` only."""
    keys = ("params", "param_bytes", "params_per_tp_rank", "expert_params", "expert_params_per_gpu", "buffer_bytes")
    sums = {key: [0] * num_stages for key in keys}
    tp, plan = run.dims.tp, run.family.tensor_parallel
    params = dict(model.named_parameters())
    for fqn, t in state_tensors(model).items():
        stage = run.family.stage_of(fqn, stage_of_layer, num_stages)
        if fqn not in params:
            sums["buffer_bytes"][stage] += t.numel() * t.element_size()
            continue
        sums["params"][stage] += t.numel()
        sums["param_bytes"][stage] += t.numel() * t.element_size()
        sums["params_per_tp_rank"][stage] += t.numel() // tp if tp > 1 and plan.splits(fqn) else t.numel()
        if fqn in grouped:
            sums["expert_params"][stage] += t.numel()
            sums["expert_params_per_gpu"][stage] += expert_rows_per_gpu(t.shape[0], run.dims) * t[0].numel()
    return sums


def _rank_plan(cfg: JobConfig, pp_rank: int, mine: list[StagePlan], dp_shard: int) -> RankPlan:
    """A pipeline rank's totals over its stages ``mine``; per GPU, the dense part (the TP rank's)
    sharded over ``dp_shard`` and the experts' share. One dtype throughout: bytes scale alike."""
    params = sum(s.params for s in mine)
    param_bytes = sum(s.param_bytes for s in mine)
    on_gpu = sum(s.params_per_tp_rank for s in mine)
    experts = (sum(s.expert_params for s in mine), sum(s.expert_params_per_gpu for s in mine))
    itemsize = param_bytes // params
    return RankPlan(
        pp_rank,
        [s.stage for s in mine],
        sum(s.flops_per_token for s in mine),
        params,
        param_bytes,
        per_gpu(on_gpu, experts, dp_shard, itemsize),
        experts[1] * itemsize,
        train_state_bytes(cfg, on_gpu, dp_shard, experts),
        sum(s.buffer_bytes for s in mine),
    )


def imbalance(values: list[int]) -> float:
    """The largest of ``values`` over their mean: 1.0 when all are equal."""
    return max(values) * len(values) / sum(values)
