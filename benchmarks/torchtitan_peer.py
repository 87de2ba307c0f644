"""torchtitan 0.3.0's own trainer, the peer of ``train.py``: ``torchtitan.train`` under torchrun on
Llama 3 1B (its ``1B`` flavor: the shapes of ``configs/llama3_1b.toml``), 4 x 2048 tokens a step,
bf16 parameters under FSDP2 with float32 reduction -- the shapes, batch and precision of
``benchmarks/throughput.py``'s ``train_eager`` and ``train_compiled`` rows -- eager, then with
``--compile.enable``. Everything else is torchtitan's default: flex attention, its chunked loss,
AdamW, CUDA graphs around forward + backward, no activation checkpointing (as ``train_eager``).

The data are random tokens, one document per row (positions 0 .. seq_len - 1), made by this
module's own ``SyntheticRows`` inside torchtitan's ``ParallelAwareDataloader``, as ``train.py``'s
rows use ``--data.kind synthetic``: nothing is read or tokenized, and a GPU machine without network
runs it. torchtitan still builds a tokenizer; a tiny ``tokenizer.json`` is written for it.

    python benchmarks/torchtitan_peer.py                                    # CUDA: 1B, 4 x 2048, 25 steps
    python benchmarks/torchtitan_peer.py --flavor debugmodel --batch 2 --seq-len 64 --steps 2 --warmup 1

This file is also torchtitan's config module (``--module torchtitan_peer --config llama3_<flavor>``,
``benchmarks/`` on ``PYTHONPATH``): torchtitan 0.3.0 configures its trainer with Python functions.

Prints one JSON line per variant (``torchtitan_eager``, ``torchtitan_compiled``): ``tokens_per_s``
(the median of torchtitan's own per-step ``tps`` after ``--warmup`` steps), ``step_time_s``
(tokens a step over that), ``peak_reserved_gib`` and ``final_loss`` from its log. Where torchtitan
does not import (not installed, or this torch too old for it: 0.3.0 needs the
``torch.distributed.fsdp.DataParallelMeshDims`` that torch 2.13 has and 2.11 has not, so the torch
2.11 image cannot run it; 2.12 untried), one ``skipped`` line per variant says why and the script exits 0.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

import torch
from common import emit, output_dir, parser

HERE = Path(__file__).resolve().parent
VARIANTS = {"torchtitan_eager": [], "torchtitan_compiled": ["--compile.enable"]}
# torchtitan's step line: "step:  3  loss: 11.9  grad_norm: ...  memory: 21.05GiB(26.6%)  tps: 41,200  ..."
STEP_LINE = re.compile(r"step:\s*(\d+)\s+loss:\s*([\d.eE+-]+|nan).*?memory:\s*([\d.]+)GiB.*?tps:\s*([\d,]+)")
ANSI = re.compile(r"\x1b\[[0-9;]*m")


# -- torchtitan's side: its config functions and the data (imported by torchtitan, in the trainer) --
def llama3_1B():  # noqa: N802 -- torchtitan's flavor name
    return peer_config("1B")


def llama3_debugmodel():
    return peer_config("debugmodel")


def peer_config(flavor: str):
    """torchtitan's ``Trainer.Config`` of Llama 3 ``flavor`` as its own ``llama3_8b`` config builds
    one, with the benchmark's differences: synthetic rows, no checkpoint, no validation, no
    activation checkpointing, a step line every step (batch, length, steps and compile come from the
    command line)."""
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.components.optimizer import default_adamw
    from torchtitan.models.common.config_utils import decoder_vocab_size
    from torchtitan.models.llama3 import model_registry
    from torchtitan.trainer import Trainer

    spec = model_registry(flavor)
    return Trainer.Config(
        model_spec=spec,
        loss=ChunkedLossWrapper.Config(loss_fn=CrossEntropyLoss.Config(global_vocab_size=decoder_vocab_size(spec))),
        optimizer=default_adamw(lr=3e-4),
        dataloader=synthetic_loader_config(decoder_vocab_size(spec)),
        metrics=MetricsProcessor.Config(log_freq=1, disable_color_printing=True),
        checkpoint=CheckpointManager.Config(enable=False),
        activation_checkpoint=None,
    )


def synthetic_loader_config(vocab_size: int):
    """The config of a torchtitan dataloader (its ``ParallelAwareDataloader``) over random rows."""
    from dataclasses import dataclass

    from torchtitan.components.dataloader import ParallelAwareDataloader

    class SyntheticLoader(ParallelAwareDataloader):
        @dataclass(kw_only=True, slots=True)
        class Config(ParallelAwareDataloader.Config):
            vocab_size: int = 0

        def __init__(self, config, *, dp_world_size, dp_rank, tokenizer, seq_len, local_batch_size, **_):
            rows = SyntheticRows(config.vocab_size, seq_len, seed=dp_rank)
            super().__init__(rows, dp_rank=dp_rank, dp_world_size=dp_world_size, batch_size=local_batch_size)

    return SyntheticLoader.Config(vocab_size=vocab_size)


class SyntheticRows(torch.utils.data.IterableDataset):
    """Endless rows of random tokens, ``({"input", "positions"}, labels)`` as torchtitan's text
    datasets yield them, one document per row."""

    def __init__(self, vocab_size: int, seq_len: int, seed: int):
        self.vocab_size, self.seq_len, self.seed = vocab_size, seq_len, seed

    def __iter__(self):
        generator = torch.Generator().manual_seed(self.seed)
        positions = torch.arange(self.seq_len)
        while True:
            row = torch.randint(0, self.vocab_size, (self.seq_len + 1,), generator=generator)
            yield {"input": row[:-1], "positions": positions}, row[1:]


# -- the driver -------------------------------------------------------------------------------------
def importable() -> str | None:
    """None where torchtitan's trainer imports here, else the one-line reason it does not."""
    try:
        import torchtitan.trainer  # noqa: F401
    except Exception as e:  # ImportError, or an AttributeError of a torch too old for it
        return f"torchtitan's trainer does not import with torch {torch.__version__}: {type(e).__name__}: {e}"
    return None


def write_tokenizer(folder: Path) -> Path:
    """A ``tokenizer.json`` of a few words with Llama 3's begin/end markers: torchtitan loads one at
    start-up even when, as here, no text is tokenized."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<|begin_of_text|>", "<|end_of_text|>", "<unk>", "a", "b"]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"})
    )
    return folder


def trainer_command(opts, variant: str, work: Path) -> list[str]:
    """torchrun running torchtitan's trainer, one rank, this module as its config."""
    return [
        *[sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1"],
        *["-m", "torchtitan.train", "--module", "torchtitan_peer", "--config", f"llama3_{opts.flavor}"],
        *["--hf-assets-path", str(work / "tokenizer"), "--dump-folder", str(work / variant)],
        *["--training.local-batch-size", str(opts.batch), "--training.seq-len", str(opts.seq_len)],
        *["--training.steps", str(opts.steps), "--training.mixed-precision-param", opts.dtype],
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


def run_variant(opts, variant: str, work: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(trainer_command(opts, variant, work), cwd=work, env=env, capture_output=True, text=True)
    sys.stderr.write(proc.stdout + proc.stderr)  # the whole log, for the suite's part log
    steps = parse_steps(proc.stdout + proc.stderr)
    if proc.returncode != 0 or not steps:
        raise SystemExit(f"benchmark failed: torchtitan's {variant} run exited with status {proc.returncode}")
    steady = [s for s in steps if s["step"] > opts.warmup] or steps[-1:]
    tps = statistics.median(s["tps"] for s in steady)
    return {
        "variant": variant,
        "tokens_per_s": tps,
        "step_time_s": opts.batch * opts.seq_len / tps,
        "steps_timed": len(steady),
        "peak_reserved_gib": max(s["gib"] for s in steps),
        "final_loss": steps[-1]["loss"],
        "batch": opts.batch,
        "seq_len": opts.seq_len,
        "flavor": opts.flavor,
        "dtype": opts.dtype,
    }


def main() -> None:
    p = parser(__doc__)
    p.set_defaults(flavor="1B")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"), help="FSDP's parameter dtype")
    p.add_argument("--steps", type=int, default=25)
    p.add_argument("--warmup", type=int, default=5, help="first steps left out of the median")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {', '.join(VARIANTS)}")
    opts = p.parse_args()
    variants = opts.variants.split(",")
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        p.error(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    if opts.flavor not in ("1B", "debugmodel"):
        p.error(f"--flavor {opts.flavor}: this peer knows 1B and debugmodel (add a llama3_<flavor> function for more)")
    reason = importable()
    if reason is not None:
        for variant in variants:
            emit({"variant": variant, "skipped": True, "reason": reason})
        return
    import importlib.metadata

    version = importlib.metadata.version("torchtitan")
    with output_dir(opts.out_dir, "torchtitan-peer-") as work:
        write_tokenizer(work / "tokenizer")
        for variant in variants:
            emit({**run_variant(opts, variant, work), "torchtitan": version})


if __name__ == "__main__":
    main()
