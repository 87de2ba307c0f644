"""torchtitan's own trainer, the peer of ``train.py``, and ``train.py`` on the same shape, in one run:
Llama 3.2 1B's shape, 4 x 2048 tokens a step, bf16 compute, eager then compiled.

The peer is torchtitan 0.2.2's ``torchtitan.train`` (its ``Trainer`` and ``main``, unchanged) under
torchrun, one rank. 0.2.2, not 0.3.0: 0.3.0's trainer needs the
``torch.distributed.fsdp.DataParallelMeshDims`` of torch 2.13, the lent GPU machine's image has torch
2.11 and no network, and a CUDA torch 2.13 (hundreds of MB with its CUDA libraries) is too large to
bring to it. 0.2.2 imports on torch 2.11 and 2.13 (the newer MoE layer of ``benchmarks/moe.py``
stays 0.3.0's, which imports on 2.11). Its Llama 3 flavors are debugmodel, 8B, 70B and 405B; this module
launches its trainer after registering a train spec (``SPEC``: torchtitan's llama3 spec, its model
and parallelize functions) with one more flavor, ``1B`` -- dim 2048, 16 layers, 32 heads, 8 KV
heads, SwiGLU 8192 wide, vocabulary 128 256, RoPE theta 500 000 with Llama 3.2's scaling (factor
32) -- and a dataloader of random tokens (``SyntheticRows``, one document per row, as ``train.py``'s
``--data.kind synthetic``: nothing is read or tokenized, no tokenizer is built).

What differs from ``benchmarks/throughput.py``'s ``train_eager`` / ``train_compiled`` rows, and how
the row keeps like with like:

* torchtitan 0.2.2 cannot tie the output projection to the embedding (Llama 3.2 1B ties them), so
  its 1B holds 1 498 482 688 parameters, the tied one 1 235 814 400. ``train.py`` runs here on the
  same untied shape (``throughput.py`` on a config this module writes from torchtitan's flavor,
  ``model.tie_word_embeddings = false``): ``train_eager_untied`` / ``train_compiled_untied``, beside
  ``bare_eager_untied`` (the bare loop, which ``throughput.py`` always runs first). The two sides'
  parameter counts are compared and the run fails if they differ.
* On one GPU torchtitan 0.2.2 applies no FSDP (only from 2 ranks): float32 parameters under
  ``torch.autocast`` to bf16, as the bare loop. ``train.py`` on one rank keeps FSDP2 on a mesh of
  one with bf16 parameters and float32 reduction.
* torchtitan's defaults otherwise: SDPA causal attention, the whole logits' float32 cross-entropy
  (``train.py``: its chunked loss), fused AdamW (lr 3e-4 here), gradient clipping at 1.0, no
  activation checkpointing (as the ``train_*`` rows). ``--compile.enable`` compiles each block and
  the loss.

    python benchmarks/torchtitan_peer.py                                 # CUDA: 1B, 4 x 2048, 25 steps
    python benchmarks/torchtitan_peer.py --flavor debugmodel --batch 2 --seq-len 64 --steps 2 --warmup 1

Prints one JSON line per variant: ``torchtitan_eager``, ``torchtitan_compiled`` (``tokens_per_s``:
the median of torchtitan's own per-step ``tps`` after ``--warmup`` steps; ``step_time_s``;
``peak_reserved_gib`` and ``final_loss`` from its log; ``n_params`` as it counts them), then
``throughput.py``'s lines relabelled ``*_untied``. ``benchmarks/suite.py`` sets each ``train_*_untied``
over its torchtitan pair (tokens/s over tokens/s; above 1, ``train.py`` is faster), as it does
``throughput.py``'s rows.

Where torchtitan 0.2.x is not importable (``make bench-gpu-prepare`` puts its wheel in
``.gpu-wheels/torchtitan_peer/``, which ``benchmarks/suite.py`` installs for this row alone: the
other rows keep 0.3.0), one ``skipped`` line per variant says why and the script exits 0. Its
imports of ``datasets`` and TensorBoard, which the peer never calls, get stand-ins where they do not
import (``stand_ins``; the lines' ``stood_in_for``): torch, transformers and the carried wheels
suffice (checked on the CPU in a Python without pyarrow, pandas or TensorBoard). Without
CUDA everything runs as on a GPU, tiny (``make bench-check``): torchtitan's trainer, which would take
``cuda`` for its device and read its memory through ``torch.cuda``, is given the CPU and a memory
monitor of zeros (``on_the_cpu``); its figures there only show that it ran.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

import torch
from common import ROOT, emit, output_dir, parser

HERE = Path(__file__).resolve().parent
VARIANTS = {"torchtitan_eager": [], "torchtitan_compiled": ["--compile.enable"]}
# train.py's rows on the peer's shape (throughput.py's names), relabelled in this row's output
OURS = {
    "bare_eager": "bare_eager_untied",
    "train_eager": "train_eager_untied",
    "train_compiled": "train_compiled_untied",
}
PAIRS = {"torchtitan_eager": "train_eager_untied", "torchtitan_compiled": "train_compiled_untied"}
SPEC = "llama3_seedckpt_peer"  # the train spec registered in torchtitan: its llama3 + 1B + random rows
# What torchtitan 0.2.2 imports as it loads but the peer never calls (its text datasets: random rows
# here; its TensorBoard writer: off), by the module whose import may fail
UNUSED = {
    "datasets": {"datasets": ("Dataset", "load_dataset"), "datasets.distributed": ("split_dataset_by_node",)},
    "torch.utils.tensorboard": {"torch.utils.tensorboard": ("SummaryWriter",)},
}
# torchtitan's step line: "step:  3  loss: 11.9  grad_norm: ...  memory: 21.05GiB(26.6%)  tps: 41,200  ..."
STEP_LINE = re.compile(r"step:\s*(\d+)\s+loss:\s*([\d.eE+-]+|nan).*?memory:\s*([\d.]+)GiB.*?tps:\s*([\d,]+)")
SIZE_LINE = re.compile(r"size:\s*([\d,]+) total parameters")
ANSI = re.compile(r"\x1b\[[0-9;]*m")


# -- torchtitan's side: in the trainer's process ----------------------------------------------------
def llama3_1b_args():
    """Llama 3.2 1B's shape (``models.llama3``'s ``1B``, which ``configs/llama3_1b.toml`` trains) in
    torchtitan 0.2.2's ``TransformerModelArgs``: the fields of the same names, its RoPE
    scaling's factors, and no tied output (0.2.2 has none)."""
    from torchtitan.models.llama3 import TransformerModelArgs
    from torchtitan.models.llama3.model.args import RoPEScalingArgs

    from models.llama3.args import LLAMA3_FLAVORS

    ours = LLAMA3_FLAVORS["1B"]
    fields = "dim n_layers n_heads n_kv_heads vocab_size multiple_of ffn_dim_multiplier norm_eps rope_theta".split()
    rope = ours.rope_scaling
    return TransformerModelArgs(
        **{field: getattr(ours, field) for field in fields},
        rope_scaling_args=RoPEScalingArgs(
            scaling_factor=rope.factor,
            low_freq_factor=rope.low_freq_factor,
            high_freq_factor=rope.high_freq_factor,
            original_max_position_embeddings=rope.original_max_position_embeddings,
        ),
    )


def peer_spec():
    """torchtitan's llama3 train spec with the 1B flavor and random rows (no tokenizer)."""
    from torchtitan.models import llama3

    spec = llama3.get_train_spec()
    return dataclasses.replace(
        spec,
        model_args={**spec.model_args, "1B": llama3_1b_args()},
        build_dataloader_fn=synthetic_loader,
        build_tokenizer_fn=None,  # SDPA causal attention needs none; nothing is tokenized
    )


def register() -> None:
    from torchtitan.protocols.train_spec import register_train_spec

    register_train_spec(SPEC, peer_spec())


def synthetic_loader(dp_world_size: int, dp_rank: int, tokenizer, job_config, **_):
    """torchtitan's ``ParallelAwareDataloader`` over random rows of the flavor's vocabulary."""
    from torchtitan.components.dataloader import ParallelAwareDataloader
    from torchtitan.protocols.train_spec import get_train_spec

    vocab = get_train_spec(job_config.model.name).model_args[job_config.model.flavor].vocab_size
    rows = SyntheticRows(vocab, job_config.training.seq_len, seed=dp_rank)
    batch = job_config.training.local_batch_size
    return ParallelAwareDataloader(rows, dp_rank=dp_rank, dp_world_size=dp_world_size, batch_size=batch)


class SyntheticRows(torch.utils.data.IterableDataset):
    """Endless rows of random tokens, ``({"input"}, labels)`` as torchtitan's text datasets yield them."""

    def __init__(self, vocab_size: int, seq_len: int, seed: int):
        self.vocab_size, self.seq_len, self.seed = vocab_size, seq_len, seed

    def __iter__(self):
        generator = torch.Generator().manual_seed(self.seed)
        while True:
            row = torch.randint(0, self.vocab_size, (self.seq_len + 1,), generator=generator)
            yield {"input": row[:-1]}, row[1:]


def trainer(argv: list[str]) -> None:
    """torchtitan's own ``main(Trainer)`` on ``argv``, the peer's spec registered first."""
    sys.argv = ["torchtitan.train", *argv]  # before torchtitan imports: its parse_args binds sys.argv then
    stand_ins()
    if not torch.cuda.is_available():
        on_the_cpu()
    register()
    from torchtitan.train import Trainer, main

    main(Trainer)


def stand_ins() -> list[str]:
    """Stand-ins for the modules of ``UNUSED`` that do not import here (the GPU image may lack
    ``datasets``' pyarrow and pandas, ~55 MB of wheels, and TensorBoard), each name refusing to be
    used: torchtitan loads, and runs as it would with them. The modules replaced."""
    import importlib
    import types

    missing = []
    for module in UNUSED:
        try:
            importlib.import_module(module)
        except ImportError:
            missing.append(module)
    for module in missing:
        for name, attrs in UNUSED[module].items():
            sys.modules[name] = types.ModuleType(name, f"a stand-in: {module} does not import here")
            for attr in attrs:
                setattr(sys.modules[name], attr, Unused)
    return missing


class Unused:
    """A name of a package that is not installed, which the peer never calls."""

    def __init__(self, *args, **kwargs):
        raise RuntimeError(f"{type(self).__name__}: the torchtitan peer stood in for a package it does not use")


def on_the_cpu() -> None:
    """torchtitan 0.2.2's trainer on the CPU, for ``make bench-check`` (its figures mean nothing
    there): it takes ``cuda`` for its device wherever no accelerator is found, and reads the device's
    memory through ``torch.cuda``. Here its device is the CPU (rank ``0`` for its barrier) and its
    memory monitor reads zeros: its trainer, spec, data and command line still run as on a GPU."""
    import torch._utils

    torch._utils._get_available_device_type = lambda: "cpu"  # read once, as torchtitan imports
    torch.cpu.current_device = lambda: 0
    from torchtitan.components import metrics

    metrics.build_device_memory_monitor = NoDeviceMemory


class NoDeviceMemory:
    """torchtitan's ``DeviceMemoryMonitor`` where there is no device memory to read: zeros."""

    device_name = "cpu"

    def get_peak_stats(self):
        from torchtitan.components.metrics import DeviceMemStats

        return DeviceMemStats(0, 0.0, 0.0, 0.0, 0, 0)

    def reset_peak_stats(self) -> None:
        pass


# -- the driver -------------------------------------------------------------------------------------
def importable() -> tuple[str, str | None]:
    """torchtitan's version ("" where it does not import) and None where its 0.2.x trainer imports
    here, else the one-line reason it does not."""
    import importlib.metadata

    fix = "pip install torchtitan==0.2.2 (make bench-gpu-prepare puts its wheel in .gpu-wheels/torchtitan_peer/)"
    try:
        version = importlib.metadata.version("torchtitan")
        import torchtitan.train  # noqa: F401
    except Exception as e:  # not installed, or an AttributeError of a torch too old for it
        why = f"{type(e).__name__}: {e}"
        return "", f"torchtitan's trainer does not import with torch {torch.__version__}: {why}; {fix}"
    if not version.startswith("0.2."):
        drives = "this peer drives 0.2.x's trainer (0.3.0's needs torch 2.13)"
        return version, f"torchtitan {version} is installed; {drives}: {fix}"
    return version, None


def trainer_args(opts, variant: str, work: Path) -> list[str]:
    """torchtitan's command line for ``variant``: its config keys, the rest its defaults."""
    return [
        *["--model.name", SPEC, "--model.flavor", opts.flavor, "--job.dump_folder", str(work / variant)],
        *["--training.local_batch_size", str(opts.batch), "--training.seq_len", str(opts.seq_len)],
        *["--training.steps", str(opts.steps), "--training.mixed_precision_param", opts.dtype],
        *["--activation_checkpoint.mode", "none", "--optimizer.lr", "3e-4"],
        *["--metrics.log_freq", "1", "--metrics.disable_color_printing"],
        *VARIANTS[variant],
    ]


def parse_steps(log: str) -> list[dict]:
    """torchtitan's per-step lines: step, loss, peak reserved GiB, tokens per second."""
    steps = []
    for line in ANSI.sub("", log).splitlines():
        match = STEP_LINE.search(line)
        if match:
            step, loss, gib, tps = match.groups()
            steps.append(
                {"step": int(step), "loss": float(loss), "gib": float(gib), "tps": float(tps.replace(",", ""))}
            )
    return steps


def failure(returncode: int, steps: list[dict], size: re.Match | None) -> str | None:
    """Why a torchtitan run gave no figures: its status where it failed, else the line its log lacks."""
    if returncode != 0:
        return f"exited with status {returncode}"
    if not steps:
        return "logged no step line"
    return None if size else "logged no 'total parameters' line"


def run_variant(opts, variant: str, work: Path) -> dict:
    """One torchrun job of torchtitan's trainer (one rank); its figures from its log."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1"]
    cmd += [str(HERE / "torchtitan_peer.py"), "--trainer", *trainer_args(opts, variant, work)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True)  # ROOT: models.llama3
    log = ANSI.sub("", proc.stdout + proc.stderr)
    sys.stderr.write(log)  # the whole log, for the suite's part log
    steps = parse_steps(log)
    size = SIZE_LINE.search(log)
    why = failure(proc.returncode, steps, size)
    if why:
        raise SystemExit(f"benchmark failed: torchtitan's {variant} run {why}")
    steady = [s for s in steps if s["step"] > opts.warmup] or steps[-1:]
    tps = statistics.median(s["tps"] for s in steady)
    return {
        "variant": variant,
        "tokens_per_s": tps,
        "step_time_s": opts.batch * opts.seq_len / tps,
        "steps_timed": len(steady),
        "peak_reserved_gib": max(s["gib"] for s in steps),
        "final_loss": steps[-1]["loss"],
        "n_params": int(size.group(1).replace(",", "")),
    }


def our_config(args, path: Path) -> Path:
    """``path``: a ``train.py`` config of the shape of ``args`` (torchtitan's ``TransformerModelArgs``),
    untied -- Llama 3's 1B with every shape field of ``args`` set in ``[model]``."""
    rope = args.rope_scaling_args
    scaling = {
        "factor": rope.scaling_factor,
        "low_freq_factor": rope.low_freq_factor,
        "high_freq_factor": rope.high_freq_factor,
        "original_max_position_embeddings": rope.original_max_position_embeddings,
    }
    shape = {f: getattr(args, f) for f in ("dim", "n_layers", "n_heads", "vocab_size", "multiple_of", "norm_eps")}
    # TOML has no None: the values torchtitan's None stands for (a multiplier of 1.0 widens nothing)
    shape |= {"n_kv_heads": args.n_kv_heads or args.n_heads, "ffn_dim_multiplier": args.ffn_dim_multiplier or 1.0}
    shape["rope_theta"] = args.rope_theta
    model = [f"{key} = {json.dumps(value)}" for key, value in shape.items()]
    model += ["rope_scaling = { " + ", ".join(f"{k} = {json.dumps(v)}" for k, v in scaling.items()) + " }"]
    model += ["tie_word_embeddings = false"]
    path.write_text('[model]\nname = "llama3"\nflavor = "1B"\n' + "\n".join(model) + "\n")
    return path


def run_ours(opts, work: Path, variants: list[str]) -> list[dict]:
    """``throughput.py`` on the peer's shape, the ``train_*`` pair of each of ``variants`` (after its
    bare_eager): its lines, relabelled (``OURS``), each printed as it comes (a run stopped at its cap
    keeps them)."""
    config = our_config(peer_spec().model_args[opts.flavor], work / f"peer_{opts.flavor}.toml")
    cmd = [sys.executable, str(HERE / "throughput.py"), "--config", str(config)]
    cmd += ["--flavor", "1B", "--batch", str(opts.batch), "--seq-len", str(opts.seq_len), "--dtype", opts.dtype]
    pairs = ",".join(PAIRS[variant].removesuffix("_untied") for variant in variants)
    cmd += ["--steps", str(opts.steps), "--warmup", str(opts.warmup), "--variants", pairs]
    lines = []
    with subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True) as proc:
        for text in proc.stdout:
            if text.startswith("{"):
                line = {**json.loads(text), "flavor": opts.flavor}
                lines.append({**line, "variant": OURS[line["variant"]]} if line.get("variant") in OURS else line)
                emit(lines[-1])
    if proc.returncode != 0:
        raise SystemExit(f"benchmark failed: throughput.py on the peer's shape exited with status {proc.returncode}")
    return lines


def same_size(theirs: int, ours: list[dict]) -> None:
    """Stop where the two sides' models differ in size: their tokens/s would not compare."""
    n_ours = next(line["n_params"] for line in ours if line.get("setup"))
    if n_ours != theirs:
        raise SystemExit(f"benchmark failed: torchtitan's model has {theirs:,} parameters, train.py's {n_ours:,}")


def main() -> None:
    p = parser(__doc__)
    p.set_defaults(flavor="1B")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"), help="the compute dtype")
    p.add_argument("--steps", type=int, default=25)
    p.add_argument("--warmup", type=int, default=5, help="first steps left out of the median")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {', '.join(VARIANTS)}")
    p.add_argument("--trainer", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)  # in torchrun's worker
    opts = p.parse_args()
    if opts.trainer is not None:
        return trainer(opts.trainer)
    variants = opts.variants.split(",")
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        p.error(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    if opts.flavor not in ("1B", "debugmodel"):
        p.error(f"--flavor {opts.flavor}: this peer knows 1B and debugmodel")
    stood_in = stand_ins()
    torchtitan, reason = importable()
    if reason is not None:
        for variant in variants:
            emit({"variant": variant, "skipped": True, "reason": reason})
        return
    shape = {"batch": opts.batch, "seq_len": opts.seq_len, "flavor": opts.flavor, "dtype": opts.dtype}
    version = {"torchtitan": torchtitan, "stood_in_for": stood_in}
    with output_dir(opts.out_dir, "torchtitan-peer-") as work:
        theirs = {}
        for variant in variants:
            theirs[variant] = run_variant(opts, variant, work)
            emit({**theirs[variant], **shape, **version})
        ours = run_ours(opts, work, variants)
        same_size(theirs[variants[0]]["n_params"], ours)


if __name__ == "__main__":
    main()
