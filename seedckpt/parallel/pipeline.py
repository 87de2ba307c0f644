"""The pipeline split: which blocks each stage owns and which stages each pipeline rank runs.

Pure arithmetic on the layer count and the ``[parallelism]`` settings, so the config checks, the
memory plan and the stage builder all compute the same split, before any process group exists.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

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


def split_layers(n_layers: int, num_stages: int, split_points: Sequence[str | int] = ()) -> list[tuple[int, ...]]:
    """Layer ids per stage.

    With ``split_points`` (``"layers.4"`` or ``4``: the first layer of each stage after the first)
    the split is explicit. Otherwise the embedding and the output projection each count as one
    layer's weight and the ``n_layers + 2`` units are cut into ``num_stages`` contiguous, nearly
    equal runs -- so the first and last stages get one block fewer. If that would leave a stage
    without a transformer block, the blocks alone are split evenly.
    """
    if num_stages < 1:
        raise SeedckptError(f"number of pipeline stages must be >= 1, got {num_stages}")
    if num_stages > n_layers:
        raise SeedckptError(
            f"cannot split {n_layers} layers into {num_stages} pipeline stages; "
            "lower parallelism.pipeline_parallel_degree or "
            "pipeline_parallel_stages_per_rank"
        )
    if split_points:
        starts = [_split_point_layer(p) for p in split_points]
        if len(starts) != num_stages - 1:
            raise SeedckptError(
                f"{len(starts)} split points give {len(starts) + 1} stages but the "
                f"pipeline has {num_stages}; give exactly {num_stages - 1} split points"
            )
        if starts != sorted(set(starts)) or starts[0] < 1 or starts[-1] > n_layers - 1:
            raise SeedckptError(
                f"split points {list(split_points)} must be strictly increasing layer "
                f"starts within layers.1..layers.{n_layers - 1}"
            )
        bounds = [0, *starts, n_layers]
        return [tuple(range(bounds[s], bounds[s + 1])) for s in range(num_stages)]
    units = n_layers + 2
    cuts = [(2 * s * units + num_stages) // (2 * num_stages) for s in range(num_stages + 1)]
    stages = [tuple(u - 1 for u in range(cuts[s], cuts[s + 1]) if 1 <= u <= n_layers) for s in range(num_stages)]
    if all(stages):
        return stages
    cuts = [(2 * s * n_layers + num_stages) // (2 * num_stages) for s in range(num_stages + 1)]
    return [tuple(range(cuts[s], cuts[s + 1])) for s in range(num_stages)]


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
) -> list[StageSpec]:
    num_stages = pp_degree * stages_per_rank
    layers = split_layers(args.n_layers, num_stages, split_points)
    return [
        StageSpec(s, num_stages, layers[s]) for s in stage_ids_for_rank(pp_rank, pp_degree, stages_per_rank, schedule)
    ]
