"""The pipeline split: which blocks each stage owns and which stages each pipeline rank runs.

Without ``parallelism.pipeline_parallel_split_points`` the stages are cut where their compute is
even: the model's family says what a token costs in each block, the embedding and the output
projection (``ModelFamily.layer_flops``, attention at ``training.seq_len``), and the split gives
every stage at least one block and makes the most expensive stage as cheap as it can be. Pure
arithmetic on the model's args and the ``[parallelism]`` settings, so the config checks, the memory
plan and the stage builder all compute the same split, before any process group exists.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from models.family import LayerCosts
from models.registry import family_of
from seedckpt.utils.errors import SeedckptError

# Schedules whose stages are placed in a "V": rank r holds stages r and 2*pp - 1 - r.
V_SCHEDULES = {"ZBVZeroBubble", "DualPipeV"}


@dataclass(frozen=True)
class StageSpec:
    stage_id: int
    num_stages: int
    layers: tuple[int, ...]

    @property
    def is_first(self) -> bool:
        return self.stage_id == 0

    @property
    def is_last(self) -> bool:
        return self.stage_id == self.num_stages - 1


def pipeline_split(
    args,
    num_stages: int,
    split_points: Sequence[str | int] = (),
    seq_len: int | None = None,
    costs: LayerCosts | None = None,
) -> list[tuple[int, ...]]:
    """Layer ids per stage of the model ``args``: at ``split_points`` if given, else balanced by
    compute with attention at ``seq_len`` (default: the model's ``max_seq_len``); ``costs``: the
    family's ``layer_flops`` at that length, if the caller has them."""
    check_stage_count(args.n_layers, num_stages)
    family = family_of(args)
    joined = family.joined_layers(args) if family.joined_layers is not None else ()
    if split_points or num_stages == 1:
        return check_joined(explicit_split(args.n_layers, num_stages, split_points), joined)
    costs = costs or family.layer_flops(args, seq_len or args.max_seq_len)
    units = _joined_units(args.n_layers, joined)  # runs of blocks no stage boundary cuts
    merged = LayerCosts(costs.first, tuple(sum(costs.blocks[i] for i in unit) for unit in units), costs.last)
    if len(units) < num_stages:
        first, last, why = joined[0]
        raise SeedckptError(
            f"cannot split {args.n_layers} layers into {num_stages} pipeline stages keeping layers {first}..{last} "
            f"on one stage ({why}); lower parallelism.pipeline_parallel_degree"
        )
    return [tuple(i for u in stage for i in units[u]) for stage in balanced_split(merged, num_stages)]


def check_joined(layers: list[tuple[int, ...]], joined) -> list[tuple[int, ...]]:
    """``layers`` per stage, refused where a boundary cuts a run of ``joined`` (``ModelFamily.joined_layers``)."""
    stage = {layer: s for s, ids in enumerate(layers) for layer in ids}
    for first, last, why in joined:
        if stage[first] != stage[last]:
            raise SeedckptError(
                f"the pipeline split puts layers {first}..{last} on stages {stage[first]}..{stage[last]}; they stay "
                f"on one stage ({why}): give parallelism.pipeline_parallel_split_points at layers.{first} or before, "
                f"or past layers.{last}"
            )
    return layers


def _joined_units(n_layers: int, joined) -> list[tuple[int, ...]]:
    """The blocks as runs a stage holds whole: each of ``joined``, every other block alone."""
    start_of = {first: last for first, last, _ in joined}
    units, i = [], 0
    while i < n_layers:
        last = start_of.get(i, i)
        units.append(tuple(range(i, last + 1)))
        i = last + 1
    return units


def check_stage_count(n_layers: int, num_stages: int) -> None:
    if num_stages < 1:
        raise SeedckptError(f"number of pipeline stages must be >= 1, got {num_stages}")
    if num_stages > n_layers:
        raise SeedckptError(
            f"cannot split {n_layers} layers into {num_stages} pipeline stages; "
            "lower parallelism.pipeline_parallel_degree or "
            "pipeline_parallel_stages_per_rank"
        )


def explicit_split(n_layers: int, num_stages: int, split_points: Sequence[str | int] = ()) -> list[tuple[int, ...]]:
    """Layer ids per stage from ``split_points`` (``"layers.4"`` or ``4``: the first layer of each
    stage after the first); none: one stage of every layer."""
    check_stage_count(n_layers, num_stages)
    starts = [_split_point_layer(p) for p in split_points]
    if len(starts) != num_stages - 1:
        raise SeedckptError(
            f"{len(starts)} split points give {len(starts) + 1} stages but the "
            f"pipeline has {num_stages}; give exactly {num_stages - 1} split points"
        )
    if starts and (starts != sorted(set(starts)) or starts[0] < 1 or starts[-1] > n_layers - 1):
        raise SeedckptError(
            f"split points {list(split_points)} must be strictly increasing layer "
            f"starts within layers.1..layers.{n_layers - 1}"
        )
    bounds = [0, *starts, n_layers]
    return [tuple(range(bounds[s], bounds[s + 1])) for s in range(num_stages)]


def balanced_split(costs: LayerCosts, num_stages: int) -> list[tuple[int, ...]]:
    """Contiguous runs of blocks, one or more per stage, the first stage with ``costs.first`` and
    the last with ``costs.last``: the dearest stage is as cheap as any split makes it, and among
    the splits that achieve that, the stage costs' sum of squares is least (the slack spread over
    the stages, not piled on one: it evens an interleaved schedule's ranks too)."""
    check_stage_count(len(costs.blocks), num_stages)
    units = list(costs.blocks)
    units[0] += costs.first
    units[-1] += costs.last
    bound = _least_bottleneck(units, num_stages)
    return _most_even_split(units, num_stages, bound)


def stage_flops(costs: LayerCosts, layers: Sequence[Sequence[int]]) -> list[int]:
    """Training FLOPs per token of each stage holding ``layers`` (the first and last with their ends)."""
    flops = [sum(costs.blocks[i] for i in ids) for ids in layers]
    flops[0] += costs.first
    flops[-1] += costs.last
    return flops


def _least_bottleneck(units: list[int], parts: int) -> int:
    """The least ``bound`` such that ``units`` cut into ``parts`` contiguous non-empty runs keep
    every run's sum <= ``bound``: a binary search on the greedy count of runs (a run can always be
    cut further without raising the most expensive one, so fewer runs than ``parts`` suffice)."""
    low, high = max(units), sum(units)
    while low < high:
        mid = (low + high) // 2
        runs, total = 1, 0
        for unit in units:
            if total + unit > mid:
                runs, total = runs + 1, 0
            total += unit
        low, high = (mid + 1, high) if runs > parts else (low, mid)
    return low


def _most_even_split(units: list[int], parts: int, bound: int) -> list[tuple[int, ...]]:
    """Of the cuts of ``units`` into ``parts`` contiguous non-empty runs of sum <= ``bound``, the
    one with the least sum of squared run sums: dynamic programming over (runs, units covered)."""
    n = len(units)
    prefix = [0]
    for unit in units:
        prefix.append(prefix[-1] + unit)
    # best[k][i]: (least sum of squares, where the last run starts) of units[:i] cut into k runs
    best = [{0: (0, 0)}] + [{} for _ in range(parts)]
    for k in range(1, parts + 1):
        for i in range(k, n - parts + k + 1):
            options = []
            for j in range(i - 1, k - 2, -1):
                if prefix[i] - prefix[j] > bound:
                    break
                if j in best[k - 1]:
                    options.append((best[k - 1][j][0] + (prefix[i] - prefix[j]) ** 2, j))
            if options:
                best[k][i] = min(options)
    starts = [n]
    for k in range(parts, 0, -1):
        starts.append(best[k][starts[-1]][1])
    starts.reverse()
    return [tuple(range(starts[s], starts[s + 1])) for s in range(parts)]


def _split_point_layer(point: str | int) -> int:
    text = str(point)
    number = text.removeprefix("layers.")
    if not number.isdigit():
        raise SeedckptError(f"split point {point!r} must look like 'layers.N' (or N)")
    return int(number)


def stage_ids_for_rank(pp_rank: int, pp_degree: int, stages_per_rank: int, schedule: str) -> list[int]:
    """Stages a pipeline rank runs: looped (``r, r + pp, ...``) or V-shaped for V schedules."""
    if schedule in V_SCHEDULES:
        if stages_per_rank != 2:
            raise SeedckptError(
                f"{schedule} needs exactly 2 stages per rank; set parallelism.pipeline_parallel_stages_per_rank = 2"
            )
        return [pp_rank, 2 * pp_degree - 1 - pp_rank]
    return [pp_rank + k * pp_degree for k in range(stages_per_rank)]


def plan_rank_stages(
    args,
    pp_rank: int,
    pp_degree: int,
    stages_per_rank: int = 1,
    schedule: str = "1F1B",
    split_points: Sequence[str | int] = (),
    seq_len: int | None = None,
) -> list[StageSpec]:
    """The stages pipeline rank ``pp_rank`` runs, split as ``pipeline_split`` does."""
    num_stages = pp_degree * stages_per_rank
    layers = pipeline_split(args, num_stages, split_points, seq_len)
    return [
        StageSpec(s, num_stages, layers[s]) for s in stage_ids_for_rank(pp_rank, pp_degree, stages_per_rank, schedule)
    ]
