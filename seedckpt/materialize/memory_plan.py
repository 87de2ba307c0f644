"""Where every parameter goes, computed on ``meta``: per stage and per rank, no allocation.

The full model is built once on ``meta`` (free even for 405B) and each tensor is attributed to the
stage that owns it, as the model's family says: the embedding to the first stage, the final norm
and output to the last, block ``i`` to the stage whose layers include ``i``. Under tensor
parallelism a rank holds ``1/tp`` of each tensor the family's plan splits and the whole of the
others (the norms), before FSDP shards what it holds over ``dp_shard``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from seedckpt.config.job_config import DTYPES, JobConfig
from seedckpt.config.resolve import ResolvedRun
from seedckpt.parallel.pipeline import split_layers, stage_ids_for_rank
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
    params: int
    param_bytes: int
    params_per_tp_rank: int  # = params without tensor parallelism


@dataclass
class RankPlan:
    pp_rank: int
    stages: list[int]
    params: int
    param_bytes: int
    param_bytes_per_dp_shard: int  # on each GPU: the TP rank's part, sharded over dp_shard
    train_state_bytes_per_gpu: int  # params + grads + AdamW moments per GPU (see train_state_bytes)


def train_state_bytes(cfg: JobConfig, params: int, dp_shard: int) -> int:
    """Parameters, gradients and AdamW moments per GPU. FSDP2 shards all of it over ``dp_shard``.
    Manual FSDP shards only the fp32 master copy and the moments: the gathered parameters (in
    ``mixed_precision_param``) and the gradient buffer (in ``mixed_precision_reduce``) are whole
    on every rank."""
    if cfg.parallelism.fsdp_impl == "manual":
        train = cfg.training
        whole = DTYPES[train.mixed_precision_param].itemsize + DTYPES[train.mixed_precision_reduce].itemsize
        return params * whole + -(-params * SHARDED_BY_MANUAL_FSDP // dp_shard)
    return -(-params * TRAIN_BYTES_PER_PARAM // dp_shard)


def make_plan(run: ResolvedRun) -> dict:
    """Parameters and bytes per stage and per rank of a resolved run (validated like a training run)."""
    cfg, args, dims = run.cfg, run.args, run.dims
    par = cfg.parallelism
    pp, per_rank, dp_shard = dims.pp, par.pipeline_parallel_stages_per_rank, dims.dp_shard
    num_stages = pp * per_rank
    layers = split_layers(args.n_layers, num_stages, par.pipeline_parallel_split_points)
    owner = {s: r for r in range(pp) for s in stage_ids_for_rank(r, pp, per_rank, par.pipeline_parallel_schedule)}
    with torch.device("meta"):
        model = run.family.model(args)
    stage_of_layer = {i: s for s, ids in enumerate(layers) for i in ids}
    counts = [0] * num_stages
    nbytes = [0] * num_stages
    per_tp_rank = [0] * num_stages
    tp, plan = dims.tp, run.family.tensor_parallel
    for fqn, t in state_tensors(model).items():
        stage = run.family.stage_of(fqn, stage_of_layer, num_stages)
        counts[stage] += t.numel()
        nbytes[stage] += t.numel() * t.element_size()
        per_tp_rank[stage] += t.numel() // tp if tp > 1 and plan.splits(fqn) else t.numel()
    stages = [
        StagePlan(s, owner[s], list(layers[s]), s == 0, s == num_stages - 1, counts[s], nbytes[s], per_tp_rank[s])
        for s in range(num_stages)
    ]
    ranks = []
    for r in range(pp):
        mine = [s for s in stages if s.pp_rank == r]
        params = sum(s.params for s in mine)
        on_gpu = sum(s.params_per_tp_rank for s in mine)  # one dtype throughout: bytes scale alike
        param_bytes = sum(s.param_bytes for s in mine)
        ranks.append(
            RankPlan(
                r,
                [s.stage for s in mine],
                params,
                param_bytes,
                -(-param_bytes * on_gpu // params // dp_shard),
                train_state_bytes(cfg, on_gpu, dp_shard),
            )
        )
    return {
        "model": cfg.model.name,
        "flavor": cfg.model.flavor,
        "args": args.to_dict(),
        "total_params": sum(counts),
        "total_bytes": sum(nbytes),
        "pipeline_parallel_degree": pp,
        "stages_per_rank": per_rank,
        "data_parallel_shard_degree": dp_shard,
        "data_parallel_replicate_degree": dims.dp_replicate,
        "tensor_parallel_degree": tp,
        "fsdp_impl": par.fsdp_impl,
        "stages": [asdict(s) for s in stages],
        "ranks": [asdict(r) for r in ranks],
    }
