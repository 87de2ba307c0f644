"""How fast the init recipe draws its numbers, on one thread, against torch's own initializers.

    python benchmarks/init_rates.py                  # 64 Mi elements each
    python benchmarks/init_rates.py --mi-elements 8  # a quick check

The recipe draws every tensor in 2^20-element chunks, each from its own generator, so a rank can draw
any range of any tensor (``seedckpt.materialize.init_recipe.generate_flat``). One JSON line per
distribution: the recipe's elements per second (``normal``, ``trunc_normal`` at +-2 std, exact
rejection sampling) beside torch's on the same count (``Tensor.normal_``,
``nn.init.trunc_normal_``), best of ``--repeats``, then the ratio. This bounds how fast a seed can be
made per core where the disk is not the limit.
"""

from __future__ import annotations

import argparse
import sys
import time

from common import ROOT, emit


def best_seconds(run, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mi-elements", type=int, default=64, help="elements drawn per measurement, in Mi (default 64)")
    p.add_argument("--repeats", type=int, default=3)
    opts = p.parse_args()
    import torch

    sys.path.insert(0, str(ROOT))
    from seedckpt.materialize.init_recipe import TensorInit, generate_flat

    torch.set_num_threads(1)
    numel = opts.mi_elements << 20
    out = torch.empty(numel)
    std = 0.02
    torch_init = {
        "normal": lambda: out.normal_(0.0, std),
        "trunc_normal": lambda: torch.nn.init.trunc_normal_(out, 0.0, std, -2 * std, 2 * std),
    }
    for kind, stock in torch_init.items():
        spec = TensorInit(kind, std=std, cutoff=2.0)  # the cutoff applies to trunc_normal only
        ours = best_seconds(lambda: generate_flat(spec, 0, "w", numel, 0, numel), opts.repeats)
        theirs = best_seconds(stock, opts.repeats)
        emit(
            {
                "distribution": kind,
                "elements": numel,
                "threads": 1,
                "recipe_m_per_s": numel / ours / 1e6,
                "torch_m_per_s": numel / theirs / 1e6,
                "recipe_vs_torch": theirs / ours,
            }
        )


if __name__ == "__main__":
    main()
