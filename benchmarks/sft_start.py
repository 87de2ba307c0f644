"""Benchmark the start of SFT from a Hugging Face directory: seedckpt vs a rank-0 broadcast start.

Run from the repository root:

    python benchmarks/sft_start.py                 # Llama-3.2-1B shapes (tied, bf16 files), 4 gloo ranks
    python benchmarks/sft_start.py --flavor debug  # a quick check of the harness

The HF directory is made first (random bf16 weights with the released shapes and tied embeddings,
streamed to safetensors shards + index + config.json). Then each method runs in its own
``torchrun --nproc-per-node RANKS`` job with FSDP2 over all ranks and fp32 parameters, and every rank
reports when its model is ready to train:

* ``seedckpt``: ``build_stages(args, ..., checkpoint=HF_DIR, shard_fn=FSDP2)`` -- every rank builds
  on ``meta``, shards, materializes its shards and reads only its rows through DCP's HF reader.
* ``broadcast_baseline`` (Mini Trainer's / the common recipe): rank 0 ``from_pretrained`` on CPU,
  the other ranks build on ``meta``, all apply ``fully_shard``, then ``set_model_state_dict(...,
  full_state_dict=True, broadcast_from_rank0=True)``.

One JSON line per (method, rank): ``ready_s`` (from the job's launch to the model being ready,
interpreter and torch start-up included), ``peak_rss_mib`` (the rank's ``VmHWM``), ``owned_mib``
(its parameter shards), ``read_mib`` (``/proc/self/io`` rchar: mmap'd reads are not in it),
``peak_anon_mib`` / ``peak_file_mib`` (sampled peaks of allocated and of file-backed resident memory:
safetensors is read through mmap, whose pages count in RSS but are page cache the kernel can drop),
and ``within_target`` / ``anon_within_target`` (peak RSS / peak anonymous RSS <= 1.3 x owned + 300
MiB). Then a line per method (slowest rank, largest RSS) and a comparison line.
The parent does not import torch (see ``common.py``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import common
from common import emit, output_dir, proc_fields, within_rss_target, write_rank_report


def make_hf_dir(path: Path, flavor: str) -> None:
    """Random bf16 weights of ``flavor`` with tied embeddings, as an HF Llama directory."""
    import dataclasses

    import torch

    from models.common.hf_names import to_hf_name
    from models.llama3.args import LLAMA3_FLAVORS
    from models.llama3.hf import hf_config
    from seedckpt.checkpoint import TensorInfo, write_json_synced
    from seedckpt.checkpoint.formats.safetensors_file import write_safetensors
    from seedckpt.materialize.model_checkpoint import codec_for

    args = dataclasses.replace(LLAMA3_FLAVORS[flavor], tie_word_embeddings=True)
    shapes = {f: s for f, s in codec_for().layout(args).shapes.items() if f != "output.weight"}
    names = {to_hf_name(f): TensorInfo(s, torch.bfloat16) for f, s in shapes.items()}
    generator = torch.Generator().manual_seed(0)

    def read(name: str) -> list[torch.Tensor]:  # one slab: the whole tensor
        shape = names[name].shape
        return [torch.ones(shape) if len(shape) == 1 else torch.randn(shape, generator=generator) * 0.02]

    shards, weight_map = [list(names)[k::2] for k in range(2)], {}
    path.mkdir(parents=True, exist_ok=True)
    for k, shard in enumerate(shards, start=1):
        file = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(path / file, {n: names[n] for n in shard}, read, {"format": "pt"})
        weight_map.update({n: file for n in shard})
    total = sum(i.nbytes for i in names.values())
    write_json_synced(
        path / "model.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": weight_map}
    )
    write_json_synced(path / "config.json", hf_config(args, torch.bfloat16))


def worker(method: str, hf_dir: str, report: str, launched: float) -> None:
    """One rank of a torchrun job: get the model ready, then report."""

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    sampler = RssSampler()
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    if method == "seedckpt":
        from seedckpt.materialize.model_checkpoint import open_model_checkpoint
        from seedckpt.materialize.stages import build_stages
        from seedckpt.parallel.parallelize import apply_fsdp
        from seedckpt.parallel.pipeline import plan_rank_stages

        args = open_model_checkpoint(hf_dir).args
        [model] = build_stages(
            args,
            plan_rank_stages(args, 0, 1),
            "cpu",
            checkpoint=hf_dir,
            shard_fn=lambda m: apply_fsdp(m, mesh, torch.float32, torch.float32, True),
        )
    else:
        import transformers
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        if dist.get_rank() == 0:
            model = transformers.LlamaForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32)
            full = model.state_dict()
        else:
            with torch.device("meta"):
                model = transformers.LlamaForCausalLM(transformers.AutoConfig.from_pretrained(hf_dir))
            full = {}
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        if dist.get_rank() != 0:
            model.to_empty(device="cpu")
        set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
        del full
    dist.barrier()
    ready = time.time() - launched
    owned = sum(p.to_local().nbytes for p in model.parameters())
    record = {
        "rank": dist.get_rank(),
        "ready_s": ready,
        "owned_mib": owned / 2**20,
        "peak_rss_mib": proc_fields("status")["VmHWM"] / 1024,
        "read_mib": proc_fields("io")["rchar"] / 2**20,
        **sampler.stop(),
    }
    write_rank_report(report, dist.get_rank(), record)
    dist.destroy_process_group()


class RssSampler:
    """Peaks of anonymous and file-backed resident memory, sampled every 5 ms on a thread: mmap'd
    safetensors pages count in RSS as file pages (the kernel can drop them), allocations as anon."""

    def __init__(self):
        import threading

        self.peaks = {"RssAnon": 0, "RssFile": 0}
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.done.wait(0.005):
            for line in Path("/proc/self/status").read_text().splitlines():
                key, _, value = line.partition(":")
                if key in self.peaks:
                    self.peaks[key] = max(self.peaks[key], int(value.split()[0]))

    def stop(self) -> dict:
        self.done.set()
        self.thread.join()
        return {"peak_anon_mib": self.peaks["RssAnon"] / 1024, "peak_file_mib": self.peaks["RssFile"] / 1024}


def run_method(method: str, hf_dir: Path, ranks: int, work: Path) -> list[dict]:
    reports, _ = common.torchrun(
        str(Path(__file__).resolve()),
        ranks,
        work / f"report-{method}",
        "--worker",
        method,
        "--hf",
        str(hf_dir),
        "--launched",
        repr(time.time()),
    )
    records = []
    for r in reports:
        r["within_target"] = within_rss_target(r["peak_rss_mib"], r["owned_mib"])
        r["anon_within_target"] = within_rss_target(r["peak_anon_mib"], r["owned_mib"])
        records.append({"method": method, **r})
        emit(records[-1])
    summary = {
        "method": method,
        "summary": True,
        "ranks": ranks,
        "ready_s": max(r["ready_s"] for r in records),
        "max_peak_rss_mib": max(r["peak_rss_mib"] for r in records),
        "all_within_target": all(r["within_target"] for r in records),
        "cpu_count": os.cpu_count(),
    }
    emit(summary)
    return records


def main() -> None:
    p = common.parser(__doc__)
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--skip-baseline", action="store_true")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--hf", help=argparse.SUPPRESS)
    p.add_argument("--report", help=argparse.SUPPRESS)
    p.add_argument("--launched", type=float, help=argparse.SUPPRESS)
    p.add_argument("--make-hf", help=argparse.SUPPRESS)
    opts = p.parse_args()
    if opts.worker:
        return worker(opts.worker, opts.hf, opts.report, opts.launched)
    if opts.make_hf:
        return make_hf_dir(Path(opts.make_hf), opts.flavor)
    with output_dir(opts.out_dir, "sft-start-") as work:
        hf_dir = work / "hf"
        common.run_checked(
            [sys.executable, str(Path(__file__).resolve()), "--make-hf", str(hf_dir), "--flavor", opts.flavor],
            "making the HF directory",
        )
        ours = run_method("seedckpt", hf_dir, opts.ranks, work)
        if opts.skip_baseline:
            return
        base = run_method("broadcast_baseline", hf_dir, opts.ranks, work)
        emit(
            {
                "comparison": True,
                "flavor": opts.flavor,
                "speedup_vs_baseline": max(r["ready_s"] for r in base) / max(r["ready_s"] for r in ours),
                "rank0_rss_ratio_vs_baseline": ours[0]["peak_rss_mib"] / base[0]["peak_rss_mib"],
                "max_rss_ratio_vs_baseline": max(r["peak_rss_mib"] for r in ours)
                / max(r["peak_rss_mib"] for r in base),
            }
        )


if __name__ == "__main__":
    main()
