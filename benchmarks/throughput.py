"""Training throughput on this machine's device: how far ``train.py`` is from the plainest loop over
the same model, and from Hugging Face's Llama, in one run.

Run from the repository root:

    python benchmarks/throughput.py                      # every variant, the device's default shapes
    python benchmarks/throughput.py --ablation           # + the eager-gap ladder (below)
    python benchmarks/throughput.py --variants bare_eager,train_eager --steps 20 --dtype bfloat16

Defaults follow the device: on CUDA the shapes of the earlier H100 measurements (``configs/llama3_1b.toml``, 1B, batch
4 x 2048, bf16 compute on fp32 parameters, 25 steps of which the first 5 are warm-up); on a CPU the
debug model (``configs/debug.toml``, batch 8 x 128, float32, 12 steps of which 3 are warm-up), so it
runs anywhere.

Variants, each in a fresh process (its own peak memory, its own compile caches):

* ``bare_eager`` -- the baseline: ``models.common.decoder.Transformer`` in the plainest loop (one fixed batch
  of random tokens, autocast to the compute dtype, mean cross-entropy, fused AdamW), as
  ``shared/gpu/train_anchor.py`` measured it on the H100.
* ``bare_compiled`` -- the same under ``torch.compile``.
* ``hf`` -- ``transformers.LlamaForCausalLM`` (sdpa) from a config of the same shapes (random, built
  here: nothing is downloaded), in the same loop.
* ``train_eager``, ``train_eager_selective``, ``train_compiled``, ``train_compiled_selective`` --
  ``python train.py`` (one rank: FSDP2 on a mesh of one when a mixed precision is asked) from a seed
  made here, synthetic data, activation checkpointing none or selective, ``training.compile``
  off / on; read back from its ``metrics.jsonl``.
* ``sft``, ``osft`` -- ``train.py`` fine-tuning that seed as the pretrained model on chat data made
  here (``tests.tiny_tokenizers``: a tiny BPE with Llama-3's chat template, packed conversations).

A config key another change adds (``training.compile``, ``optimizer.implementation``) is used when
``seedckpt.config.job_config`` has it; a variant that needs a missing one prints a ``skipped`` line saying so.

``--ablation`` adds the *eager-gap ladder*: the bare loop with the trainer's per-step work added one
piece at a time, each rung keeping the ones before it (``ablate_<rung>``; see ``RUNGS``). The step
time a rung adds over the one before is what that piece costs. ``ablate_data`` is what ``train.py``
does on one rank in float32; ``ablate_fsdp2`` adds FSDP2 on a mesh of one, which the trainer applies
only with a mixed precision (then ``ablate_fsdp2`` is its path); ``ablate_fsdp2_keep_gathered`` stops
re-gathering the parameters in backward (a config setting, not a code path). ``train_fused`` (when
``optimizer.implementation`` exists) is
``train.py`` with fused AdamW.

Output: one JSON line per variant -- ``tokens_per_s`` and ``step_time_s`` (median over the steps
after warm-up), ``step_time_min_s`` (their fastest: on a shared machine noise only ever adds, so a
rung's ``added_ms`` is taken between minima; ``--repeat`` pools several round-robin rounds),
``peak_mem_gib`` (CUDA: max allocated; CPU: the process's peak RSS, interpreter and
torch included), ``mfu_pct`` (null where the device's peak is not known: a CPU, an unlisted GPU, or
float32 compute), ``vs_baseline`` (tokens/s over ``bare_eager``'s in this run), ``first_step_s``
(``train.py`` variants: the first step, which under ``training.compile`` compiles). Children run with
``OMP_NUM_THREADS=--threads`` (default 1), so CPU variants share the machine alike.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path

from common import ROOT, emit, output_dir, parser, run_checked, write_rank_report

BARE = ("bare_eager", "bare_compiled", "hf")
# train.py variants: (activation checkpointing, compiled, finetune mode)
TRAIN = {
    "train_eager": ("none", False, "none"),
    "train_eager_selective": ("selective", False, "none"),
    "train_compiled": ("none", True, "none"),
    "train_compiled_selective": ("selective", True, "none"),
    "sft": ("none", False, "sft"),
    "osft": ("none", False, "osft"),
}
DEFAULT_VARIANTS = (*BARE, *TRAIN)
# The eager-gap ladder: what train.py does per step beyond the bare loop, added in this order.
RUNGS = {
    "loss_sum": "loss as train.py computes it: summed token cross-entropy x 1 / (label tokens counted on the host)",
    "clip": "gradient clipping by the global norm (seedckpt.train.trainer.clip_grad_norm_, foreach)",
    "adamw_default": "train.py's AdamW (torch's default implementation, not fused) and its LR schedule",
    "host_syncs": "train.py's per-step telemetry: loss.item(), peak_memory_bytes, the stats tensor and its two "
    "all-reduces, grad_norm.item()",
    "logging": "a metrics.jsonl row and a progress line per step (seedckpt.train.metrics.MetricsLogger)",
    "data": "each step's batch from train.py's dataset (synthetic), built on the host and copied to the device",
    "fsdp2": "FSDP2 on a mesh of one (fully_shard per block and the root; its mixed precision replaces autocast)",
    "fsdp2_keep_gathered": "FSDP2 keeping the gathered (cast) parameters from forward to backward: "
    "train.py's parallelism.fsdp_reshard_after_forward = never",
}
# New config keys this benchmark uses once they exist: (section, key) -> the variants that need them.
NEEDS = {
    ("training", "compile"): {"train_compiled", "train_compiled_selective"},
    ("optimizer", "implementation"): {"train_fused"},
}
CUDA_DEFAULTS = dict(
    config="configs/llama3_1b.toml", flavor="1B", batch=4, seq_len=2048, dtype="bfloat16", steps=25, warmup=5
)
CPU_DEFAULTS = dict(
    config="configs/debug.toml", flavor="debug", batch=8, seq_len=128, dtype="float32", steps=12, warmup=3
)


# -- in the child processes (torch is imported only there: see common.py) ------------------------------
def _model_args(opts):
    from seedckpt.config.job_config import load_config

    return load_config(opts.config, ["--model.flavor", opts.flavor]).model_args()


def probe(opts, report: str) -> None:
    """The device, the settings for it (``opts`` left unset take its defaults), torch's version,
    which new config keys this tree has, the model's size, and (for sft / osft) a tokenizer and chat
    data under ``--chat-dir``."""
    import torch

    from seedckpt.config.job_config import JobConfig
    from seedckpt.train.metrics import peak_tflops

    cuda = torch.cuda.is_available()
    opts = with_defaults(opts, "cuda" if cuda else "cpu")
    args = _model_args(opts)
    family = JobConfig().model_family()
    with torch.device("meta"):
        n_params = sum(p.numel() for p in family.model(args).parameters())  # tied: once
    device_name = torch.cuda.get_device_name() if cuda else f"CPU ({os.cpu_count()} cores)"
    peak = peak_tflops(device_name, opts.dtype) if cuda else None  # the trainer's table: never made up
    sections = {f.name: f.default_factory for f in dataclasses.fields(JobConfig)}
    keys = {
        f"{section}.{key}": section in sections and key in {f.name for f in dataclasses.fields(sections[section])}
        for section, key in NEEDS
    }
    if opts.chat_dir:
        from tests.tiny_tokenizers import build_tiny_tokenizer, corpus_of, make_chats

        chats = make_chats(2000, seed=0)
        folder = Path(opts.chat_dir)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "chats.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chats))
        build_tiny_tokenizer(folder / "tokenizer", corpus_of(chats), vocab_size=min(300, args.vocab_size))
    write_rank_report(
        report,
        0,
        {
            "device": "cuda" if cuda else "cpu",
            "settings": {k: getattr(opts, k) for k in CPU_DEFAULTS},
            "device_name": device_name,
            "torch": torch.__version__,
            "keys": keys,
            "n_params": n_params,
            "peak_flops": None if peak is None else peak * 1e12,
            "flops_per_token": family.flops_per_token(args, opts.seq_len),
        },
    )


def bare_loop(opts, variant: str, report: str) -> None:
    """``variant``: ``bare_eager``, ``bare_compiled``, ``hf`` or ``ablate_<rung>`` (the eager loop with
    every rung up to and including ``<rung>``); writes the median step time after warm-up."""
    import contextlib

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from seedckpt.config.job_config import LrScheduler
    from seedckpt.data.sources import IGNORE_INDEX, SyntheticData
    from seedckpt.train.metrics import MetricsLogger, peak_memory_bytes
    from seedckpt.train.optimizer import lr_factor
    from seedckpt.train.trainer import _init_process_group, clip_grad_norm_

    rungs = list(RUNGS)
    on = set(rungs[: rungs.index(variant.removeprefix("ablate_")) + 1]) if variant.startswith("ablate_") else set()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, opts.dtype)
    args = _model_args(opts)
    torch.manual_seed(0)
    if on & {"host_syncs", "fsdp2"}:
        _init_process_group(device.type)  # a world of one, as train.py makes it without torchrun
    if variant == "hf":
        from transformers import LlamaConfig, LlamaForCausalLM

        from models.llama3.hf import hf_config

        hf = LlamaForCausalLM(LlamaConfig(**hf_config(args, torch.float32), attn_implementation="sdpa")).to(device)
        model, forward = hf, lambda tokens: hf(input_ids=tokens).logits
    else:
        from models.common.decoder import Transformer

        with torch.device(device):
            model = Transformer(args)  # nn.Linear's own init: the values do not matter here
        forward = torch.compile(model) if variant == "bare_compiled" else model
    autocast = dtype != torch.float32
    if "fsdp2" in on:
        from torch.distributed.device_mesh import init_device_mesh

        from seedckpt.parallel.parallelize import apply_fsdp

        apply_fsdp(
            model,
            init_device_mesh(device.type, (1,)),
            dtype,
            torch.float32,
            reshard_after_forward="fsdp2_keep_gathered" not in on,
        )
        autocast = False  # FSDP2 casts the parameters itself, as in train.py
    params = [p for p in model.parameters()]
    trainer_adamw = "adamw_default" in on
    optimizer = torch.optim.AdamW(
        params, lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, **({} if trainer_adamw else {"fused": True})
    )
    scheduler = (
        torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor(LrScheduler(), 2, opts.steps)) if trainer_adamw else None
    )
    data = SyntheticData(args.vocab_size, opts.seq_len, 0) if "data" in on else None
    rows = torch.randint(0, args.vocab_size, (opts.batch, opts.seq_len + 1), device=device)
    inputs, labels = rows[:, :-1], rows[:, 1:]
    labels_on_host = labels.cpu()
    logger = MetricsLogger(Path(report).parent / f"{variant}-metrics") if "logging" in on else None
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times = []
    for step in range(1, opts.steps + 1):
        sync()
        t0 = time.perf_counter()
        if data is not None:
            batch = data.global_batch(step, opts.batch)
            labels_on_host = batch.labels
            inputs, labels = batch.inputs.to(device), batch.labels.to(device)
        with torch.autocast(device.type, dtype=dtype) if autocast else contextlib.nullcontext():
            logits = forward(inputs)
        if "loss_sum" in on:
            label_tokens = int((labels_on_host != IGNORE_INDEX).sum())
            loss = F.cross_entropy(
                logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
            ) * (1 / max(1, label_tokens))
        else:
            loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
        loss.backward()
        if "host_syncs" in on:
            total = torch.zeros((), device=device)
            total += loss.detach()
        grad_norm = clip_grad_norm_(params, 1.0, None) if "clip" in on else None
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if scheduler is not None:
            scheduler.step()
        if "host_syncs" in on:
            stats = torch.tensor([total.item(), float(peak_memory_bytes(device))], dtype=torch.float64, device=device)
            dist.all_reduce(stats[:1])
            dist.all_reduce(stats[1:], op=dist.ReduceOp.MAX)
            values = {
                "step": step,
                "steps": opts.steps,
                "loss": stats[0].item(),
                "lr": optimizer.param_groups[0]["lr"],
                "grad_norm": grad_norm.item(),
                "peak_mem_bytes": int(stats[1].item()),
            }
        if logger is not None:
            elapsed = time.perf_counter() - t0
            logger.log(
                {
                    **values,
                    "label_tokens": label_tokens,
                    "tokens_per_s": opts.batch * opts.seq_len / elapsed,
                    "step_time_s": elapsed,
                    "data_wait_s": 0.0,
                }
            )
        sync()
        times.append(time.perf_counter() - t0)
    if logger is not None:
        logger.close()
    if dist.is_initialized():
        dist.destroy_process_group()
    write_rank_report(
        report,
        0,
        {"step_times_s": times[opts.warmup :], "peak_mem_bytes": peak_memory_bytes(device), "final_loss": loss.item()},
    )


# -- the driver ------------------------------------------------------------------------------------
def child_env(opts) -> dict:
    return {
        **os.environ,
        "OMP_NUM_THREADS": str(opts.threads),
        "THP_MEM_ALLOC_ENABLE": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }


def shape_args(opts) -> list[str]:
    """The settings as options for a worker (those still unset: the probe picks them by device)."""
    return [
        arg
        for key in CPU_DEFAULTS
        if getattr(opts, key) is not None
        for arg in (f"--{key.replace('_', '-')}", str(getattr(opts, key)))
    ]


def run_worker(opts, worker: str, work: Path, *extra: str) -> dict:
    report = work / f"{worker}.json"
    run_checked(
        [sys.executable, __file__, "--worker", worker, "--report", str(report), *shape_args(opts), *extra],
        f"the {worker} worker",
        env=child_env(opts),
    )
    return json.loads(Path(f"{report}.rank0").read_text())


def run_train(opts, variant: str, seed: Path, chat: Path, work: Path) -> dict:
    """One ``python train.py`` job (a world of one); its metrics rows after warm-up."""
    ac, compiled, finetune = TRAIN.get(variant, ("none", False, "none"))
    run_dir = work / variant
    cmd = [
        sys.executable,
        "train.py",
        "--config",
        opts.config,
        "--model.flavor",
        opts.flavor,
        "--checkpoint.seed_checkpoint",
        str(seed),
        "--checkpoint.folder",
        str(run_dir / "ckpt"),
        "--checkpoint.enable",  # the steps are measured, not the saves (benchmarks/save.py)
        "false",
        "--job.dump_folder",
        str(run_dir),
        "--training.steps",
        str(opts.steps),
        "--training.local_batch_size",
        str(opts.batch),
        "--training.global_batch_size",
        "-1",
        "--training.seq_len",
        str(opts.seq_len),
        "--training.mixed_precision_param",
        opts.dtype,
        "--training.mixed_precision_reduce",
        "float32",
        "--parallelism.pipeline_parallel_degree",
        "1",
        "--parallelism.data_parallel_shard_degree",
        "-1",
        "--metrics.log_freq",
        "1",
        "--activation_checkpoint.mode",
        ac,
        "--data.kind",
        "synthetic",
    ]
    if compiled:
        cmd += ["--training.compile", "true"]
    if variant == "train_fused":
        cmd += ["--optimizer.implementation", "fused"]
    if finetune != "none":
        cmd += [
            "--finetune.mode",
            finetune,
            "--finetune.pretrained",
            str(seed),
            "--data.kind",
            "chat",
            "--data.path",
            str(chat / "chats.jsonl"),
            "--data.tokenizer",
            str(chat / "tokenizer"),
        ]
    run_checked(cmd, f"the {variant} train.py run", env=child_env(opts))
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steady = [r for r in rows if r["step"] > opts.warmup]
    return {
        "step_times_s": [r["step_time_s"] for r in steady],
        "first_step_s": rows[0]["step_time_s"],  # with training.compile: the compilation
        "peak_mem_bytes": max(r["peak_mem_bytes"] for r in rows),
        "final_loss": rows[-1]["loss"],
    }


def summarize(variant: str, result: dict, opts, info: dict, baseline: float | None) -> dict:
    step = statistics.median(result["step_times_s"])
    tokens_per_s = opts.batch * opts.seq_len / step
    peak = info["peak_flops"]
    return {
        "variant": variant,
        "device": info["device_name"],
        "torch": info["torch"],
        "tokens_per_s": tokens_per_s,
        "step_time_s": step,
        "step_time_min_s": min(result["step_times_s"]),
        "mfu_pct": None if peak is None else 100 * info["flops_per_token"] * tokens_per_s / peak,
        "peak_mem_gib": result["peak_mem_bytes"] / 2**30,
        "vs_baseline": None if baseline is None else tokens_per_s / baseline,
        "steps_timed": len(result["step_times_s"]),
        "first_step_s": result.get("first_step_s"),  # train.py runs only
        "batch": opts.batch,
        "seq_len": opts.seq_len,
        "flavor": opts.flavor,
        "dtype": opts.dtype,
        "final_loss": result["final_loss"],
    }


def main() -> None:
    p = parser(__doc__)
    p.set_defaults(flavor=None)
    p.add_argument("--config", help="job config of the model and the train.py runs (default: by device, above)")
    p.add_argument("--batch", type=int, help="sequences per step (default: 4 on CUDA, 8 on a CPU)")
    p.add_argument("--seq-len", type=int, help="tokens per sequence (default: 2048 on CUDA, 128 on a CPU)")
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        help="compute dtype: autocast in the bare "
        "loops, mixed_precision_param in train.py (default: bfloat16 on CUDA, float32 on a CPU)",
    )
    p.add_argument("--steps", type=int, help="steps per variant (default: 25 on CUDA, 12 on a CPU)")
    p.add_argument("--warmup", type=int, help="first steps left out of the median (default: 5 on CUDA, 3 on a CPU)")
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of every child (default 1)")
    p.add_argument(
        "--variants",
        help=f"comma list (default: {','.join(DEFAULT_VARIANTS)}); bare_eager, the baseline, always runs first",
    )
    p.add_argument("--repeat", type=int, default=1, help="rounds over all variants, round-robin (default 1)")
    p.add_argument("--ablation", action="store_true", help="add the eager-gap ladder (ablate_*) and train_fused")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--report", help=argparse.SUPPRESS)
    p.add_argument("--chat-dir", help=argparse.SUPPRESS)
    opts = p.parse_args()
    if opts.worker == "probe":
        return probe(opts, opts.report)
    if opts.worker:
        return bare_loop(opts, opts.worker, opts.report)

    ablation = [f"ablate_{rung}" for rung in RUNGS] + ["train_fused"] if opts.ablation else []
    variants = [v for v in (opts.variants.split(",") if opts.variants else DEFAULT_VARIANTS) if v] + ablation
    known = {*DEFAULT_VARIANTS, *(f"ablate_{rung}" for rung in RUNGS), "train_fused"}
    if set(variants) - known:
        p.error(f"unknown variants {sorted(set(variants) - known)}; choose from {', '.join(sorted(known))}")
    variants = ["bare_eager", *dict.fromkeys(v for v in variants if v != "bare_eager")]
    with output_dir(opts.out_dir, "throughput-bench-") as work:
        fine_tuning = {"sft", "osft"} & set(variants)
        info = run_worker(opts, "probe", work, *(["--chat-dir", str(work / "chat")] if fine_tuning else []))
        opts = argparse.Namespace(**{**vars(opts), **info["settings"]})
        emit(
            {
                "setup": True,
                **{k: v for k, v in info.items() if k not in ("keys", "settings")},
                **info["keys"],
                "config": opts.config,
                "flavor": opts.flavor,
                "batch": opts.batch,
                "seq_len": opts.seq_len,
                "dtype": opts.dtype,
                "steps": opts.steps,
                "warmup": opts.warmup,
                "threads": opts.threads,
                "peak_flops": info["peak_flops"],
            }
        )
        seed = work / "seed"
        if set(variants) & {*TRAIN, "train_fused"}:
            run_checked(
                [
                    sys.executable,
                    "create_seed_checkpoint.py",
                    "--config",
                    opts.config,
                    "--model.flavor",
                    opts.flavor,
                    "--output",
                    str(seed),
                    "--force",
                    "--quiet",
                ],
                "seeding",
                env={**child_env(opts), "OMP_NUM_THREADS": str(os.cpu_count())},  # the seed's init on every core
            )
        runnable = []
        for variant in variants:
            missing = [
                f"{s}.{k}" for (s, k), needers in NEEDS.items() if variant in needers and not info["keys"][f"{s}.{k}"]
            ]
            if missing:
                emit(
                    {
                        "variant": variant,
                        "skipped": True,
                        "reason": f"this tree's seedckpt.config.job_config has no {', '.join(missing)}",
                    }
                )
            else:
                runnable.append(variant)
        # Round-robin rounds: on a shared machine the load drifts, and each round samples it for every
        # variant alike; a variant's steps of all rounds are pooled. Each variant's line is printed as
        # soon as its last round ends, so a run stopped partway (a time cap) keeps what it measured.
        pooled = {v: {"step_times_s": [], "peak_mem_bytes": 0, "wall_s": 0.0} for v in runnable}
        baseline = previous_min = None
        for round_ in range(opts.repeat):
            for variant in runnable:
                start = time.perf_counter()
                result = (
                    run_train(opts, variant, seed, work / "chat", work)
                    if variant in TRAIN or variant == "train_fused"
                    else run_worker(opts, variant, work)
                )
                pooled[variant] = {
                    "step_times_s": pooled[variant]["step_times_s"] + result["step_times_s"],
                    "peak_mem_bytes": max(pooled[variant]["peak_mem_bytes"], result["peak_mem_bytes"]),
                    "final_loss": result["final_loss"],
                    "first_step_s": result.get("first_step_s"),  # the last round's
                    "wall_s": pooled[variant]["wall_s"] + time.perf_counter() - start,
                }
                if round_ < opts.repeat - 1:
                    continue
                record = summarize(variant, pooled[variant], opts, info, baseline)
                if variant == "bare_eager":
                    baseline = record["tokens_per_s"]
                    record["vs_baseline"] = 1.0
                if variant.startswith("ablate_"):
                    record["adds"] = RUNGS[variant.removeprefix("ablate_")]
                    record["added_ms"] = 1e3 * (record["step_time_min_s"] - previous_min)
                if variant == "bare_eager" or variant.startswith("ablate_"):
                    previous_min = record["step_time_min_s"]
                emit({**record, "rounds": opts.repeat, "wall_s": pooled[variant]["wall_s"]})


def with_defaults(opts, device: str) -> argparse.Namespace:
    """``opts`` with every setting left unset taken from ``device``'s defaults."""
    defaults = CUDA_DEFAULTS if device == "cuda" else CPU_DEFAULTS
    return argparse.Namespace(**{**vars(opts), **{k: v for k, v in defaults.items() if getattr(opts, k) is None}})


if __name__ == "__main__":
    main()
