"""The ``seedckpt`` command: seed, inspect, verify, plan, convert, diff, launch.

User errors (``SeedckptError``) and environment errors (``OSError``: disk full, permission denied)
print one line and exit 2; no traceback. Ctrl-C, SIGTERM and SIGHUP remove what was being written,
print one line and exit 128 + the signal's number (``utils.signals``).
"""

from __future__ import annotations

import argparse
import atexit
import gc
import json
import math
import os
import sys
import textwrap
import time
import warnings
from pathlib import Path
from typing import NoReturn

from seedckpt.utils.collector import collector_paused
from seedckpt.utils.errors import SeedckptError
from seedckpt.utils.signals import how_stopped, stop_on_signals

# When the command started (this module is imported first and imports nothing heavy): a duration a
# command prints is its wall time from here, or names the part it times.
STARTED = time.perf_counter()
# At exit Python's collector scans every object still alive, and torch's and DCP's imports leave
# ~250,000: 1.8-2.2 s of a seed's end after its work was done (a busy 2-core machine), 0.4 s with
# them frozen first. Nothing is collected by it then; the memory goes back whole with the process.
atexit.register(gc.freeze)

EXAMPLES = {
    "seed": """
        examples:
          seedckpt seed --config configs/debug.toml --output seeds/debug
          seedckpt seed --config configs/llama3_8b.toml --output /shared/seeds/8b --dtype bfloat16
          seedckpt seed --config configs/debug.toml --output /tmp/s --model.n_layers 8 --force""",
    "inspect": """
        examples:
          seedckpt inspect seeds/debug
          seedckpt inspect seeds/debug --json | python -m json.tool""",
    "verify": """
        examples:
          seedckpt verify seeds/debug
          seedckpt verify outputs/demo/checkpoints/step-100
          seedckpt verify tokens/                        # a token directory (seedckpt tokenize)
          seedckpt verify Llama-3.2-1B/                  # HF (or quantized): every value read, NaN/Inf named
        exit status: 0 intact (NaN or Inf values are warned about; nothing recorded to check: it says so),
        2 damaged or unreadable""",
    "plan": """
        examples:
          seedckpt plan --config configs/llama3_8b.toml
          seedckpt plan --config configs/llama3_70b.toml --world-size 64 --parallelism.pipeline_parallel_degree 8
          seedckpt plan --config configs/debug.toml --model.flavor 405B --parallelism.pipeline_parallel_degree 16""",
    "convert": """
        examples:
          seedckpt convert outputs/demo/checkpoints/step-100 exported/ --to hf --dtype bfloat16
          seedckpt convert Llama-3.2-1B/ seeds/llama1b --to dcp        # an HF download, for SFT
          seedckpt convert seeds/debug debug.safetensors --to safetensors
          seedckpt convert seeds/debug debug.pt --to torch
          seedckpt convert seeds/debug tt_seed --to torchtitan   # torchtitan 0.3 names
          seedckpt convert osft_run/step-100 next_task/ --to dcp --dense   # OSFT factors -> dense weights""",
    "diff": """
        examples:
          seedckpt diff seeds/debug exported/               # a DCP checkpoint vs its HF export
          seedckpt diff run/step-100 run/step-200 --atol 1e-3
        exit status: 0 equal, 1 different, 2 error""",
    "tokenize": """
        examples:
          seedckpt tokenize corpus/ --tokenizer ./tokenizer --output tokens/
          seedckpt tokenize a.jsonl b.jsonl.gz c.parquet --tokenizer ./tokenizer --output tokens/ --workers 8
          seedckpt launch --nproc-per-node 4 train.py --config C --data.kind tokens --data.path tokens/
          seedckpt tokenize chats.jsonl --chat --tokenizer ./tokenizer --output chat_tokens/   # SFT, label mask
          seedckpt launch --nproc-per-node 4 train.py --config C --finetune.mode sft ... --data.kind tokens \\
              --data.path chat_tokens/""",
}


class _ParserListingConfigKeys(argparse.ArgumentParser):
    """A parser whose ``--help`` ends with every config key (``config_reference``) when
    ``lists_config_keys``: ``seedckpt --help`` and the commands that take ``--section.key value``
    (``seed``, ``plan``). Rendered only when help is printed, since seedckpt.config.job_config
    imports torch, which ``seedckpt seed`` must not load before it has set its environment variables."""

    def __init__(self, *args, lists_config_keys: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.lists_config_keys = lists_config_keys

    def format_help(self) -> str:
        if not self.lists_config_keys:
            return super().format_help()
        from seedckpt.config.job_config import config_reference

        return f"{super().format_help()}\n{config_reference()}\n"


def _parser() -> argparse.ArgumentParser:
    parser = _ParserListingConfigKeys(
        prog="seedckpt",
        description="Seed checkpoints for pipeline x FSDP2 LLM training.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="run `seedckpt COMMAND --help` for each command's options and examples",
        lists_config_keys=True,
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_ParserListingConfigKeys)

    def add(name: str, help: str, lists_config_keys: bool = False) -> argparse.ArgumentParser:
        return sub.add_parser(
            name,
            help=help,
            description=help,
            epilog=textwrap.dedent(EXAMPLES[name]),
            formatter_class=argparse.RawDescriptionHelpFormatter,
            lists_config_keys=lists_config_keys,
        )

    seed = add(
        "seed",
        "Initialize the full model on CPU and write a DCP seed checkpoint. "
        "Any config key can be overridden with --section.key value (listed below the examples).",
        lists_config_keys=True,
    )
    seed.add_argument("--config", required=True, help="job config TOML, e.g. configs/debug.toml")
    seed.add_argument("--output", help="checkpoint directory (default: checkpoint.seed_checkpoint)")
    seed.add_argument("--seed", type=int, help="init seed (default: training.seed)")
    seed.add_argument("--dtype", default="float32", help="float32 (default) or bfloat16")
    seed.add_argument("--force", action="store_true", help="replace an existing checkpoint")
    seed.add_argument("--quiet", action="store_true", help="no progress output")
    seed.add_argument(
        "--workers", type=int, help="generating and writing threads, one data file each (default: every usable core)"
    )

    inspect = add("inspect", "List a checkpoint's tensors (shape, dtype, bytes) and manifest.")
    inspect.add_argument("checkpoint", help="checkpoint directory")
    inspect.add_argument("--json", action="store_true", help="machine-readable output")

    verify = add(
        "verify",
        "Read every byte of a checkpoint and check it against the CRC32C checksums written with "
        "it, and every data file's length; names each damaged tensor and file, and each tensor holding "
        "NaN or Inf. A checkpoint without checksums (Hugging Face, quantized, one file) has every tensor "
        "read and its values checked (quantized ones dequantized, their scales checked).",
    )
    verify.add_argument("checkpoint", help="checkpoint directory or file")
    verify.add_argument("--quiet", action="store_true", help="no progress output")

    plan = add(
        "plan",
        "Show which layers, parameters and bytes each pipeline stage and rank gets "
        "(computed on meta: no memory, works for 405B). Any config key can be overridden with "
        "--section.key value (listed below the examples).",
        lists_config_keys=True,
    )
    plan.add_argument("--config", required=True, help="job config TOML")
    plan.add_argument("--world-size", type=int, help="resolve data_parallel_shard_degree = -1 against this")
    plan.add_argument("--json", action="store_true", help="machine-readable output")

    convert = add(
        "convert",
        "Convert a checkpoint between DCP, Hugging Face (sharded safetensors + index + "
        "config.json), one safetensors file and torch.save, one tensor at a time. The "
        "source format is detected.",
    )
    convert.add_argument("src", help="DCP dir, HF dir, .safetensors file or torch.save file")
    convert.add_argument("dst", help="output directory (dcp, hf) or file (safetensors, torch)")
    convert.add_argument("--to", required=True, help="dcp | hf | safetensors | torch | torchtitan (0.3 names)")
    convert.add_argument("--dtype", help="cast every tensor: float32 | bfloat16 | float16")
    convert.add_argument("--max-shard-size", default="5GB", help="hf shard size (default 5GB)")
    convert.add_argument("--config", help="job config describing the model, for sources without a manifest")
    convert.add_argument(
        "--dense",
        action="store_true",
        help="an OSFT checkpoint: write each target's dense weight U diag(S) V^T instead of its "
        "factors (always done for hf and torchtitan)",
    )
    convert.add_argument("--force", action="store_true", help="replace an existing output")
    convert.add_argument(
        "--no-verify", action="store_true", help="skip checking the bytes read against the source's checksums"
    )
    convert.add_argument(
        "--allow-non-finite",
        action="store_true",
        help="write tensors holding NaN or Inf as they are (by default the first is named and nothing is written)",
    )
    convert.add_argument("--quiet", action="store_true", help="no progress output")

    tokenize = add(
        "tokenize",
        "Tokenize text, JSONL or parquet corpora once into a token directory (uint32 tokens.bin + tokens.json) that "
        "training reads window by window (--data.kind tokens --data.path DIR): in parallel over the cores, "
        "each document's ids followed by the tokenizer's eos, written under a temporary name and renamed when "
        "complete. With --chat, conversations rendered with the chat template, with a label mask (mask.bin) and "
        "an index (documents.bin), which training packs as data.kind = chat does. `seedckpt verify DIR` checks it.",
    )
    tokenize.add_argument(
        "sources",
        nargs="+",
        metavar="INPUT",
        help='JSONL {"text": ...} / JSONL.gz / parquet (a "text" column) / plain text file(s), or directories of '
        "them (*.jsonl, *.jsonl.gz, *.parquet, *.txt: a warning names the files skipped), each file once; a "
        'file named of another kind is read as plain text. With --chat, JSONL {"messages": [...]} or Mini '
        'Trainer\'s {"input_ids", "labels"} file(s) or directories (*.jsonl, *.jsonl.gz)',
    )
    tokenize.add_argument(
        "--chat",
        action="store_true",
        help="the inputs are conversations: render them with the tokenizer's chat template and keep the "
        "assistant tokens' label mask, for SFT",
    )
    tokenize.add_argument("--tokenizer", required=True, help="a Hugging Face tokenizer directory (tokenizer.json)")
    tokenize.add_argument("--output", required=True, help="the token directory to create")
    tokenize.add_argument("--workers", type=int, help="tokenizing processes (default: every usable core)")
    tokenize.add_argument("--quiet", action="store_true", help="no progress output")

    # Listed for `seedckpt --help`; `seedckpt launch ...` is dispatched before this parser (see main).
    sub.add_parser(
        "launch",
        add_help=False,
        help="torchrun with one line per failure instead of its traceback: "
        "seedckpt launch --standalone --nproc-per-node 4 train.py --config C",
    )

    diff = add(
        "diff",
        "Compare two checkpoints of any supported formats tensor by tensor (HF names and the "
        "q/k permutation are mapped, so a checkpoint equals its HF export).",
    )
    diff.add_argument("a")
    diff.add_argument("b")
    diff.add_argument(
        "--atol",
        type=float,
        default=0.0,
        help="largest |difference| still called equal; above 0 a dtype mismatch alone is no difference",
    )
    diff.add_argument("--config", help="job config describing the model, for sources without a manifest")
    diff.add_argument("--no-verify", action="store_true", help="skip checking the bytes read against checksums")
    return parser


def _one_line_warning(message, category, filename, lineno, line=None) -> str:
    """A command's warnings as one line each, like its errors (not Python's file:line + source)."""
    return f"warning: {message}\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["launch"]:  # torchrun's own arguments, parsed by torchrun's parser
        from seedckpt.cli.launch import main as launch

        return launch(argv[1:])
    warnings.formatwarning = _one_line_warning
    parser = _parser()
    opts, rest = parser.parse_known_args(argv)
    if rest and opts.command in ("inspect", "verify", "convert", "diff", "tokenize"):
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        commands = {
            "seed": _seed,
            "inspect": _inspect,
            "verify": _verify,
            "plan": _plan,
            "convert": _convert,
            "diff": _diff,
            "tokenize": _tokenize,
        }
        with stop_on_signals():  # SIGTERM and SIGHUP clean up as Ctrl-C does
            return commands[opts.command](opts, rest)
    except BrokenPipeError:  # output piped into `head` and closed: not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (SeedckptError, OSError) as e:  # OSError: disk full, permission denied, ...
        print(f"seedckpt {opts.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:  # every writer removes its partial output on the way out
        output = getattr(opts, "output", None) or getattr(opts, "dst", None)
        words, status = how_stopped(e)
        print(
            f"seedckpt {opts.command}: {words}" + (f"; nothing was written to {output}" if output else ""),
            file=sys.stderr,
        )
        return status


def _seed(opts, overrides) -> int:
    # CPU only: hide GPUs before anything could create a CUDA context (and pin memory) on a GPU host.
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    # Transparent huge pages for torch's large CPU allocations (read once, before torch allocates):
    # every 64 MiB block is a fresh allocation, and faulting it in 4 KiB pages cost ~3 s of system
    # time on the 1B seed here; with 2 MiB pages 1 s (wall 15.7 s -> 11.1 s, untied 1B on tmpfs).
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    with collector_paused():  # torch's and DCP's imports: serial time before any worker starts
        from seedckpt.config.job_config import load_config
        from seedckpt.materialize.seed import create_seed_checkpoint

    cfg = load_config(opts.config, overrides)
    output = opts.output or cfg.checkpoint.seed_checkpoint
    if not output:
        raise SeedckptError("no output directory: pass --output DIR or set checkpoint.seed_checkpoint")
    seed = cfg.training.seed if opts.seed is None else opts.seed
    path = create_seed_checkpoint(
        cfg, output, seed=seed, dtype=opts.dtype, force=opts.force, progress=not opts.quiet, workers=opts.workers
    )
    print(f"wrote seed checkpoint {path} (model {cfg.model.name} {cfg.model.flavor}, seed {seed}, {opts.dtype})")
    return 0


def _inspect(opts, _rest) -> int:
    """DCP: every entry of the metadata (optimizer state included) and the manifest. Other formats
    (HF directory, .safetensors, torch.save): their model tensors in our names."""
    from seedckpt.checkpoint import dtype_name
    from seedckpt.materialize.model_checkpoint import open_model_checkpoint

    source = open_model_checkpoint(opts.checkpoint)
    tensors = {fqn: t for fqn, t in source.tensors().items() if fqn not in source.aliases}  # stored ones
    args = source.args.to_dict() if source.args else None
    total = sum(t.nbytes for t in tensors.values())
    if opts.json:
        print(
            json.dumps(
                {
                    "path": str(source.path),
                    "format": source.kind,
                    "manifest": source.manifest,
                    "args": args,
                    "num_tensors": len(tensors),
                    "total_bytes": total,
                    "tensors": {
                        fqn: {"shape": list(t.shape), "dtype": dtype_name(t.dtype), "bytes": t.nbytes}
                        for fqn, t in tensors.items()
                    },
                    "tied": source.aliases,
                    "checksums": _checksum_note(source),
                },
                indent=1,
            )
        )
        return 0
    m = source.manifest
    print(f"checkpoint {source.path} ({source.kind})")
    if m:
        model = m.get("model", {})
        print(
            f"  kind {m.get('kind')}  model {model.get('name')} {model.get('flavor')}  seed {m.get('seed')}  "
            f"dtype {m.get('dtype')}  created {m.get('created')}  torch {m.get('torch_version')}"
        )
    else:
        print("  no seedckpt manifest")
    if args:
        print(f"  args {json.dumps(args)}")
    print(f"  {_checksum_note(source)}")
    print(f"  {len(tensors)} tensors, {sum(t.numel for t in tensors.values()):,} elements, {_gib(total)}")
    width = max((len(f) for f in tensors), default=0)
    for fqn, t in tensors.items():
        print(f"  {fqn:<{width}}  {str(list(t.shape)):<16} {dtype_name(t.dtype):<9} {t.nbytes:>14,}")
    for fqn, stored in source.aliases.items():
        print(f"  {fqn}: tied, not stored (reads {stored})")
    return 0


def _checksum_note(source) -> str:
    checksums = source.checksums
    if checksums is not None:
        return (
            f"checksums: crc32c of every byte ({len(checksums.items)} items); `seedckpt verify` reads and checks them"
        )
    if source.kind == "dcp":
        return "no checksum: written before seedckpt recorded them, or by another tool; contents cannot be verified"
    return f"no checksum: {source.kind} files carry none; contents cannot be verified"


def _tokenize(opts, _rest) -> int:
    from seedckpt.data.token_files import read_token_manifest
    from seedckpt.data.tokenize import tokenize_corpus

    if opts.workers is not None and opts.workers < 1:
        raise SeedckptError(f"--workers {opts.workers}: it must be >= 1")
    path = tokenize_corpus(opts.sources, opts.tokenizer, opts.output, opts.workers, not opts.quiet, opts.chat)
    made = read_token_manifest(path)
    what = "conversations" if opts.chat else "documents"
    print(
        f"wrote {path}: {made['tokens']:,} tokens, {made['documents']:,} {what}, vocabulary {made['vocab_size']:,}; "
        f"train on it with --data.kind tokens --data.path {path}"
    )
    return 0


def _verify(opts, _rest) -> int:
    """Exit 0 when every item matches its checksum (or, with none recorded, say so), 2 otherwise."""
    from seedckpt.data.token_files import MANIFEST_FILE, verify_tokens
    from seedckpt.materialize.model_checkpoint import open_model_checkpoint
    from seedckpt.utils.progress import Progress

    if (Path(opts.checkpoint) / MANIFEST_FILE).is_file():  # a token directory
        print(f"intact: {opts.checkpoint}: {verify_tokens(Path(opts.checkpoint)):,} tokens")
        return 0

    # Checks .metadata's checksum, data file lengths, headers; not whether it is a whole model.
    source = open_model_checkpoint(opts.checkpoint, complete=False)
    checksums = source.checksums
    if checksums is None:
        return _verify_values(source, opts.quiet)
    total = sum(item.length for item in checksums.items.values())
    bar = Progress(total, "verify", enabled=not opts.quiet)
    start = time.perf_counter()
    try:
        problems = source.verify(bar.update)
    finally:
        bar.close()
    for problem in problems:
        print(problem)
    for fqn in sorted(getattr(source, "nonfinite", ())):
        print(f"warning: {fqn} holds NaN or Inf values (its bytes are intact; training from it stops at load)")
    if problems:
        print(f"damaged: {len(problems)} of {len(checksums.items)} items of {source.path} fail their checks")
        return 2
    seconds = time.perf_counter() - start
    print(
        f"intact: {source.path}: {len(checksums.items)} items, {_gib(total)}; reading and checking them took "
        f"{seconds:.2f} s ({total / max(seconds, 1e-9) / 1e9:.2f} GB/s), the whole command "
        f"{time.perf_counter() - STARTED:.2f} s (start-up and opening the checkpoint included)"
    )
    return 0


def _verify_values(source, quiet: bool) -> int:
    """A checkpoint without checksums: every stored tensor read once (dequantized where stored
    quantized, a slab at a time, which checks its scales) and its values checked; each holding NaN or Inf is named.
    Exit 0: its files are whole, whatever their values (as for checksums, non-finite values warn)."""
    from seedckpt.checkpoint.base import nonfinite_count
    from seedckpt.cli.convert import refuse_verify_beyond_memory
    from seedckpt.utils.progress import Progress

    refuse_verify_beyond_memory(source)
    reads = list(source.stored_reads())
    total = sum(nbytes for _, nbytes, _ in reads)
    bar = Progress(total, "verify", enabled=not quiet)
    nonfinite = []
    try:
        for what, nbytes, slabs in reads:
            bad = values = 0
            for slab in slabs():  # a quantized tensor a bounded slab at a time, never whole
                bad, values = bad + nonfinite_count(slab), values + slab.numel()
            if bad:
                nonfinite.append(f"warning: {what} holds {bad:,} NaN or Inf values of {values:,}")
            bar.update(nbytes)
    finally:
        bar.close()
    for line in nonfinite:
        print(line)
    values = f"{len(nonfinite)} of them hold NaN or Inf" if nonfinite else "every value finite"
    print(f"read: {source.path}: {len(reads)} tensors, {_gib(total)}, {values}; {_checksum_note(source)}")
    return 0


def _plan(opts, overrides) -> int:
    from seedckpt.config.job_config import load_config
    from seedckpt.config.resolve import default_world_size, resolve
    from seedckpt.materialize.memory_plan import make_plan

    cfg = load_config(opts.config, overrides)
    # fine-tuning: the pretrained checkpoint's model, vocabulary grown for the tokenizer
    if opts.world_size is not None and opts.world_size < 1:
        raise SeedckptError(f"--world-size {opts.world_size}: it must be >= 1 (the number of ranks)")
    plan = make_plan(resolve(cfg, opts.world_size or default_world_size(cfg), local_world_size=0))
    if opts.json:
        print(json.dumps(plan, indent=1))
        return 0
    buffers = f" (+ {_gib(plan['buffer_bytes'])} of persistent buffers)" if plan["buffer_bytes"] else ""
    print(
        f"{plan['model']} {plan['flavor']}: {plan['total_params']:,} params, {_gib(plan['total_bytes'])}{buffers}; "
        f"pp={plan['pipeline_parallel_degree']} x {plan['stages_per_rank']} stage(s)/rank, "
        f"dp_shard={plan['data_parallel_shard_degree']}, dp_replicate={plan['data_parallel_replicate_degree']}, "
        f"tp={plan['tensor_parallel_degree']}, ep={plan['expert_parallel_degree']}"
    )
    if plan["experts"]:
        print(
            f"  experts: {plan['experts']} per MoE layer, {plan['experts_per_ep_rank']} per EP rank; "
            f"each GPU stores {plan['expert_rows_per_gpu']} of them (FSDP2 over the ranks holding the same ones)"
        )
    print(
        f"  {'stage':>5} {'pp_rank':>7}  {'layers':<12} {'extra':<12} {'GFLOP/token':>11} {'params':>16} {'bytes':>12}"
    )
    for s in plan["stages"]:
        extra = "+".join(x for x, on in (("embed", s["has_embeddings"]), ("output", s["has_output"])) if on)
        print(
            f"  {s['stage']:>5} {s['pp_rank']:>7}  {_span(s['layers']):<12} {extra:<12} "
            f"{s['flops_per_token'] / 1e9:>11.3f} {s['params']:>16,} {_gib(s['param_bytes']):>12}"
        )
    print(
        f"  {'pp_rank':>7} {'stages':<10} {'GFLOP/token':>11} {'params':>16} {'bytes':>12} {'per GPU':>13} "
        f"{'experts/GPU':>12} {'train/GPU':>12}"
    )
    for r in plan["ranks"]:
        print(
            f"  {r['pp_rank']:>7} {str(r['stages']):<10} {r['flops_per_token'] / 1e9:>11.3f} {r['params']:>16,} "
            f"{_gib(r['param_bytes']):>12} {_gib(r['param_bytes_per_dp_shard']):>13} "
            f"{_gib(r['expert_bytes_per_gpu']):>12} {_gib(r['train_state_bytes_per_gpu']):>12}"
        )
    worst = plan["imbalance"]
    print(
        f"  imbalance (max/mean, 1.00 = even): stage compute {worst['stage_flops']:.2f}, stage bytes "
        f"{worst['stage_bytes']:.2f}; rank compute {worst['rank_flops']:.2f}, rank bytes/GPU "
        f"{worst['rank_bytes_per_gpu']:.2f} (training FLOPs per token, attention at training.seq_len = "
        f"{plan['seq_len']})"
    )
    if plan["fsdp_impl"] == "manual":
        print(
            "  train/GPU = manual FSDP: gathered params + gradient buffer whole on every rank, fp32 master "
            "copy + AdamW moments (12 B/param) sharded over dp_shard; activations not included"
        )
    else:
        print(
            "  train/GPU = fp32 params + grads + AdamW moments (16 B/param) of the TP rank's part, sharded over "
            "dp_shard (experts: the GPU's share); activations not included"
        )
    return 0


def _model(config: str | None) -> dict:
    """``--config``'s model (family and args) for checkpoints that record none; else the default family."""
    from seedckpt.config.job_config import load_config

    if not config:
        return {}
    cfg = load_config(config)
    return {"args": cfg.model_args(), "model": cfg.model.name}


def _convert(opts, _rest) -> int:
    from seedckpt.cli.convert import convert

    path = convert(
        opts.src,
        opts.dst,
        opts.to,
        dtype=opts.dtype,
        max_shard_size=opts.max_shard_size,
        force=opts.force,
        progress=not opts.quiet,
        dense=opts.dense,
        verify=not opts.no_verify,
        allow_non_finite=opts.allow_non_finite,
        **_model(opts.config),
    )
    print(f"wrote {opts.to} checkpoint {path}")
    return 0


def _diff(opts, _rest) -> int:
    from seedckpt.cli.convert import diff

    if not (math.isfinite(opts.atol) and opts.atol >= 0):
        raise SeedckptError(f"--atol {opts.atol}: it must be a finite number >= 0 (0: bitwise equal)")
    equal, lines = diff(opts.a, opts.b, atol=opts.atol, verify=not opts.no_verify, **_model(opts.config))
    print("\n".join(lines))
    return 0 if equal else 1


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**26 else f"{n / 2**20:.2f} MiB"


def _span(layers: list[int]) -> str:
    return f"{layers[0]}-{layers[-1]}" if len(layers) > 1 else str(layers[0])


def run(argv: list[str] | None = None) -> NoReturn:
    """The process entry of the command (the ``seedckpt`` script, ``python -m seedckpt.cli``,
    create_seed_checkpoint.py); ``main`` stays callable in-process. A seed ends with ``exit_now``:
    Python's teardown of torch's objects skipped after the checkpoint is published (0.94x a 1-layer
    seed's wall). The other commands exit the ordinary way: only the seed was measured, and its end
    has no writer left running."""
    argv = sys.argv[1:] if argv is None else argv
    code = main(argv)
    if argv[:1] == ["seed"]:
        from seedckpt.materialize.seed import exit_now

        exit_now(code)
    sys.exit(code)


if __name__ == "__main__":
    run()
