"""Benchmark OSFT: the distributed SVD against its ideal and Mini Trainer's split, the layer's forward
choice, and OSFT against SFT on one layout.

Run from the repository root:

    python benchmarks/osft.py                                # 8B shapes, 1 layer, ranks 1,2,4
    python benchmarks/osft.py --flavor debug --n-layers 2    # a quick check of the harness
    python benchmarks/osft.py --flavor 1B --n-layers 2 --measure device   # the GPU suite's part

Set-up: a seed of ``--flavor`` with ``--n-layers`` layers and a 1024-token vocabulary (the
transformer blocks keep the flavor's shapes; the vocabulary only sizes the embedding, which OSFT
does not decompose). It serves as ``finetune.pretrained``. JSON lines on stdout:

* ``svd_serial`` (one process, one thread): ``seconds`` of ``decompose`` for every target matrix,
  one by one, and their sum ``sum_s`` -- the work to divide.
* ``svd_distributed``, per rank count N in ``--ranks`` and per ``split``: ``cost_balanced`` (ours,
  longest-processing-time on m*n*min(m, n)) and ``contiguous`` (Mini Trainer's: equal-count blocks
  of the target list). ``fill_s``: the slowest rank's time in ``osft.fill_factors`` (reading,
  SVDs, broadcasting shards), ``ideal_s`` = sum_s / N, ``over_ideal`` = fill_s / ideal_s (target
  <= 1.15). Each rank runs one thread (OMP_NUM_THREADS=1), so N above the machine's cores
  (``cpu_count``) cannot scale.
* ``svd_device``, per target shape: ``decompose`` on the CPU (all its cores) against the training
  device (CUDA where present; one warm-up first), ``cpu_s``, ``device_s``, ``speedup``, and the
  device factors' agreement with the CPU's (``max_rel_diff``, target <= 1e-4) and their rebuild of W
  (``rebuild_rel_err``, target <= 1e-5). Without CUDA one line says it was skipped.
* ``forward``, per target shape: forward + backward seconds over 2048 tokens of the dense linear
  (SFT), OSFT's factorized layer (what ``OSFTLinear`` does), and the alternative -- a dense frozen
  U_high S_high V_high^T plus the low-rank trainable path -- with the parameter bytes each holds.
* ``train``, per mode (``sft``, ``osft`` with ratio 0.25) on the same layout (``--train-ranks``
  FSDP2 ranks, ``--local-batch-size`` rows of ``--seq-len`` tokens per rank, synthetic data):
  median ``step_time_s`` after two warm-up steps and ``peak_mem_mib`` (the largest rank's peak
  RSS), then their ratios (targets: step time <= 1.5 x, memory <= 1.2 x SFT).

The parent does not import torch (see ``common.py``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import common
from common import emit, output_dir, run_checked, write_rank_report

SCRIPT = str(Path(__file__).resolve())
RATIO = 0.25
# svd: serial and distributed (whose ideal is the serial sum); device: CPU against CUDA; forward; train.
MEASURES = ("svd", "device", "forward", "train")
TOKENS = 2048


def contiguous_split(costs: dict[str, int], workers: int) -> list[list[str]]:
    """Mini Trainer's assignment: the targets in model order, cut into equal-count contiguous blocks."""
    names = list(costs)
    size = -(-len(names) // workers)
    return [names[w * size : (w + 1) * size] for w in range(workers)]


def svd_worker(opts: argparse.Namespace) -> None:
    """One rank: build the model FSDP2-sharded over all ranks with OSFT from the seed; time fill_factors."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import seedckpt.finetune.osft as osft
    import seedckpt.materialize.stages as stages
    from seedckpt.materialize.model_checkpoint import open_model_checkpoint
    from seedckpt.parallel.parallelize import apply_fsdp
    from seedckpt.parallel.pipeline import plan_rank_stages

    dist.init_process_group("gloo")
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,)) if world > 1 else None
    if opts.split == "contiguous":
        osft.assign_by_cost = contiguous_split
    timed = {}
    fill = stages.fill_factors

    def timed_fill(*args, **kwargs):
        dist.barrier()
        start = time.perf_counter()
        result = fill(*args, **kwargs)
        timed["fill_s"] = time.perf_counter() - start
        return result

    stages.fill_factors = timed_fill
    args = open_model_checkpoint(opts.seed).args
    shard = (lambda m: apply_fsdp(m, mesh, torch.float32, torch.float32, True)) if mesh else None
    stages.build_stages(
        args,
        plan_rank_stages(args, 0, 1),
        "cpu",
        checkpoint=opts.seed,
        shard_fn=shard,
        osft=osft.OSFTSettings(RATIO),
        stage_group=mesh.get_group() if mesh else None,
    )
    write_rank_report(opts.report, dist.get_rank(), timed)
    dist.destroy_process_group()


def serial_svds(seed: str) -> dict[str, float]:
    """Seconds of ``decompose`` per target matrix, one process, one thread."""
    import torch

    from models.common.decoder import Transformer
    from seedckpt.finetune.osft import decompose, target_fqns
    from seedckpt.materialize.model_checkpoint import open_model_checkpoint

    torch.set_num_threads(1)
    reader = open_model_checkpoint(seed)
    with torch.device("meta"):
        model = Transformer(reader.args)
    seconds = {}
    for fqn in target_fqns(model, []):
        weight = reader.read_tensor(f"{fqn}.weight")
        start = time.perf_counter()
        decompose(weight, RATIO)
        seconds[fqn] = time.perf_counter() - start
    return seconds


def device_svds(seed: str) -> list[dict]:
    """``decompose`` of one matrix per target shape on the CPU (every core) and on CUDA."""
    import os

    import torch

    from models.common.decoder import Transformer
    from seedckpt.finetune.osft import decompose, target_fqns
    from seedckpt.materialize.model_checkpoint import open_model_checkpoint

    if not torch.cuda.is_available():
        return [{"benchmark": "svd_device", "skipped": "no CUDA device"}]
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    reader = open_model_checkpoint(seed)
    with torch.device("meta"):
        model = Transformer(reader.args)
    shapes = {}
    for fqn in target_fqns(model, []):
        shapes.setdefault(tuple(model.get_submodule(fqn).weight.shape), fqn)
    decompose(torch.randn(256, 512, device="cuda"), RATIO)  # CUDA context and solver warm-up
    rows = []
    for shape, fqn in shapes.items():
        weight = reader.read_tensor(f"{fqn}.weight")
        start = time.perf_counter()
        on_cpu = decompose(weight, RATIO)
        cpu_s = time.perf_counter() - start
        weight_gpu = weight.cuda()
        torch.cuda.synchronize()
        start = time.perf_counter()
        on_gpu = decompose(weight_gpu, RATIO)
        torch.cuda.synchronize()
        device_s = time.perf_counter() - start
        rebuilt = (on_gpu.U_high * on_gpu.S_high) @ on_gpu.V_high.T + (on_gpu.U_low * on_gpu.S_low) @ on_gpu.V_low.T
        rebuild = ((rebuilt - weight_gpu.float()).norm() / weight_gpu.float().norm()).item()
        gpu_factors = dict(on_gpu.items())
        agree = max(
            ((gpu_factors[name].cpu() - t).abs().max() / t.abs().max().clamp_min(1e-30)).item()
            for name, t in on_cpu.items()
        )
        rows.append(
            {
                "benchmark": "svd_device",
                "shape": list(shape),
                "device": torch.cuda.get_device_name(),
                "cpu_threads": torch.get_num_threads(),
                "cpu_s": cpu_s,
                "device_s": device_s,
                "speedup": cpu_s / device_s,
                "max_rel_diff": agree,
                "rebuild_rel_err": rebuild,
            }
        )
    return rows


def forward_costs(seed: str) -> list[dict]:
    """Forward + backward of one target shape: dense (SFT), factorized (OSFT), dense-high + low-rank."""
    import torch
    import torch.nn.functional as F

    from seedckpt.finetune.osft import OSFTLinear, decompose
    from seedckpt.materialize.model_checkpoint import open_model_checkpoint

    torch.set_num_threads(1)
    reader = open_model_checkpoint(seed)
    shapes = sorted(
        {
            reader.infos[f].shape
            for f in reader.infos
            if f.startswith("layers.0.")
            and f.endswith("w1.weight")
            or f.startswith("layers.0.")
            and f.endswith(("wq.weight", "wk.weight", "w2.weight"))
        }
    )
    records = []
    for m, n in shapes:
        weight = torch.randn(m, n) / n**0.5
        x = torch.randn(TOKENS, n)
        layer = OSFTLinear(n, m, RATIO)
        layer.load_factors(decompose(weight, RATIO))
        dense_w = weight.clone().requires_grad_()
        high = ((layer.U_high * layer.S_high) @ layer.V_high.T).detach()

        def dense_high_low_rank():
            low = F.linear(F.linear(x, layer.V_low.T) * layer.S_low, layer.U_low)
            return F.linear(x, high) + low

        variants = {
            "dense_sft": lambda: F.linear(x, dense_w),
            "osft_factorized": lambda: layer(x),
            "osft_dense_high": dense_high_low_rank,
        }
        params = {
            "dense_sft": weight.numel(),
            "osft_factorized": sum(p.numel() for p in layer.parameters()),
            "osft_dense_high": high.numel() + sum(p.numel() for p in layer.parameters()),
        }
        for name, run in variants.items():
            run().sum().backward()  # warm-up
            start = time.perf_counter()
            for _ in range(3):
                run().sum().backward()
            records.append(
                {
                    "benchmark": "forward",
                    "shape": [m, n],
                    "variant": name,
                    "tokens": TOKENS,
                    "fwd_bwd_s": (time.perf_counter() - start) / 3,
                    "param_bytes": 4 * params[name],
                }
            )
    return records


def train_mode(opts: argparse.Namespace, seed: Path, work: Path, mode: str) -> dict:
    run = work / f"train-{mode}"
    common.remove(run)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={opts.train_ranks}",
        "train.py",
        "--config",
        "configs/debug.toml",
        "--model.flavor",
        opts.flavor,
        "--model.n_layers",
        str(opts.n_layers),
        "--model.vocab_size",
        "1024",
        "--finetune.mode",
        mode,
        "--finetune.pretrained",
        str(seed),
        "--finetune.osft_unfreeze_rank_ratio",
        str(RATIO),
        "--data.kind",
        "synthetic",
        "--parallelism.pipeline_parallel_degree",
        "1",
        "--training.local_batch_size",
        str(opts.local_batch_size),
        "--training.seq_len",
        str(opts.seq_len),
        "--training.steps",
        str(opts.steps),
        "--checkpoint.interval",
        "0",
        "--checkpoint.folder",
        str(run / "ckpt"),
        "--job.dump_folder",
        str(run),
    ]
    run_checked(cmd, f"train.py --finetune.mode {mode}", env={**common.os.environ, "OMP_NUM_THREADS": "1"})
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {
        "benchmark": "train",
        "mode": mode,
        "ranks": opts.train_ranks,
        "local_batch_size": opts.local_batch_size,
        "seq_len": opts.seq_len,
        "step_time_s": statistics.median(r["step_time_s"] for r in rows[2:]),
        "peak_mem_mib": max(r["peak_mem_bytes"] for r in rows) / 2**20,
        "final_loss": rows[-1]["loss"],
        "cpu_count": common.os.cpu_count(),
    }


def run_all(opts: argparse.Namespace, work: Path) -> None:
    seed = work / "seed"
    run_checked(
        [
            sys.executable,
            "create_seed_checkpoint.py",
            "--config",
            "configs/debug.toml",
            "--model.flavor",
            opts.flavor,
            "--model.n_layers",
            str(opts.n_layers),
            "--model.vocab_size",
            "1024",
            "--parallelism.pipeline_parallel_degree",
            "1",
            "--output",
            str(seed),
            "--force",
            "--quiet",
        ],
        "create_seed_checkpoint.py",
    )
    labels = {"flavor": opts.flavor, "n_layers": opts.n_layers, "ratio": RATIO}
    if "svd" in opts.measure:
        run_svds(opts, seed, work, labels)
    for name, helper in (("device", "--device-svd"), ("forward", "--forward")):
        if name in opts.measure:
            for record in json.loads(run_checked_output([sys.executable, SCRIPT, helper, str(seed)])):
                emit({**record, **labels})
    if "train" not in opts.measure:
        return
    sft, osft = (train_mode(opts, seed, work, mode) for mode in ("sft", "osft"))
    emit({**sft, **labels})
    emit({**osft, **labels})
    emit(
        {
            "benchmark": "train_comparison",
            **labels,
            "step_time_ratio": osft["step_time_s"] / sft["step_time_s"],
            "memory_ratio": osft["peak_mem_mib"] / sft["peak_mem_mib"],
        }
    )


def run_svds(opts: argparse.Namespace, seed: Path, work: Path, labels: dict) -> None:
    serial = json.loads(run_checked_output([sys.executable, SCRIPT, "--serial", str(seed)]))
    total = sum(serial.values())
    emit({"benchmark": "svd_serial", **labels, "sum_s": total, "seconds": serial})
    for ranks in (int(r) for r in opts.ranks.split(",") if r):  # --ranks "": no distributed SVD
        for split in ("cost_balanced", "contiguous") if ranks > 1 else ("cost_balanced",):  # one rank: the same
            records, _ = common.torchrun(
                SCRIPT, ranks, work / f"svd-{ranks}-{split}", "--svd-worker", "--split", split, "--seed", str(seed)
            )
            fill = max(r["fill_s"] for r in records)
            emit(
                {
                    "benchmark": "svd_distributed",
                    **labels,
                    "ranks": ranks,
                    "split": split,
                    "fill_s": fill,
                    "ideal_s": total / ranks,
                    "over_ideal": fill / (total / ranks),
                    "cpu_count": common.os.cpu_count(),
                }
            )


def run_checked_output(cmd: list[str]) -> str:
    """Run a torch-side helper of this script in a fresh process and return its stdout."""
    proc = common.subprocess.run(
        cmd, cwd=common.ROOT, capture_output=True, text=True, env={**common.os.environ, "OMP_NUM_THREADS": "1"}
    )
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr)
        raise SystemExit(f"benchmark failed: {' '.join(cmd[1:3])} exited with status {proc.returncode}")
    return proc.stdout


def main() -> None:
    parser = common.parser(__doc__)
    parser.set_defaults(flavor="8B")
    parser.add_argument("--n-layers", type=int, default=1, help="transformer blocks of the flavor (default 1)")
    parser.add_argument("--ranks", default="1,2,4", help='rank counts for the distributed SVD ("": none)')
    parser.add_argument("--train-ranks", type=int, default=2, help="FSDP2 ranks for OSFT vs SFT")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--local-batch-size", type=int, default=1, help="rows per rank and step in the training runs")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument(
        "--measure",
        type=lambda text: set(text.split(",")),
        default=set(MEASURES),
        help=f"comma list of {', '.join(MEASURES)} (default: all)",
    )
    for hidden in ("--serial", "--device-svd", "--forward", "--seed", "--report", "--split"):
        parser.add_argument(hidden, help=argparse.SUPPRESS)
    parser.add_argument("--svd-worker", action="store_true", help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.measure - set(MEASURES):
        parser.error(f"--measure: unknown {sorted(opts.measure - set(MEASURES))}; choose from {', '.join(MEASURES)}")
    if opts.serial:
        print(json.dumps(serial_svds(opts.serial)))
    elif opts.device_svd:
        print(json.dumps(device_svds(opts.device_svd)))
    elif opts.forward:
        print(json.dumps(forward_costs(opts.forward)))
    elif opts.svd_worker:
        svd_worker(opts)
    else:
        with output_dir(opts.out_dir, "seedckpt-osft-bench-") as work:
            run_all(opts, work)


if __name__ == "__main__":
    main()
