"""Benchmark ``seedckpt convert`` (DCP <-> Hugging Face) against ``cp`` and DCP's ``format_utils``.

Run from the repository root:

    python benchmarks/convert.py --flavor 1B
    python benchmarks/convert.py --flavor 8B --skip-format-utils --out-dir /big/disk/bench

Setup (one ``setup_seed`` line, for reference): a float32 seed checkpoint of the flavor, written by
``create_seed_checkpoint.py --config configs/debug.toml --model.flavor F --output SEED --quiet --force``.
Then four measurements, each printed as one JSON line on stdout:

* ``cp``: the floor for copying the seed's bytes -- ``cp -r SEED CP_DIR``.
* ``dcp_to_hf``: the product, ``python -m seedckpt.cli.main convert SEED HF_DIR --to hf --quiet``. Its
  line includes ``throughput_vs_cp`` (its GB/s over cp's).
* ``hf_to_dcp``: the way back, ``python -m seedckpt.cli.main convert HF_DIR DCP_DIR --to dcp --quiet``.
* ``format_utils``: stock ``torch.distributed.checkpoint.format_utils.dcp_to_torch_save(SEED, FILE)``,
  which loads the whole model into memory before ``torch.save``. Skip it with ``--skip-format-utils``
  for flavors whose full model does not fit in RAM.

Each command runs in its own fresh subprocess; ``wall_s`` times that process plus an ``os.sync()``
after it exits, so writes still in the page cache are paid for by whoever made them (convert fsyncs
its files, cp and torch.save do not). Sources are read warm: each was written just before.
``peak_rss_gib`` is the child's own peak resident memory from ``os.wait4``. This script does not
import torch: on Linux a child's ru_maxrss starts at its parent's peak RSS at spawn time (the
parent's memory is recorded when the child execs), so a torch-laden parent would floor every reading.
``bytes_written`` sums the files in the output; ``gb_per_s`` is that over the wall time (GB = 1e9
bytes). The convert lines also carry ``rss_bound_gib`` -- 2 x the largest tensor (sizes from the
seed's ``seedckpt.json`` manifest) + 300 MiB, what reading whole tensors once needed (slabs need far
less: ``--big``) -- and ``rss_within_bound``.

A last line compares them: ``dcp_to_hf_throughput_vs_cp``, ``dcp_to_hf_rss_gib`` and
``format_utils_rss_gib`` (null when skipped). The CPU count and OMP_NUM_THREADS are recorded on every
measurement line.

``--big`` measures memory against tensor size instead: a one-layer debug model whose tied embedding
is ``--big-mib`` MiB (default 256; 128 values a row), then each of ``dcp_to_hf``, ``hf_to_dcp``,
``dcp_to_safetensors``, ``diff`` (seed vs HF) and ``verify`` (of the HF directory, which has no
checksums: every value read) twice, interleaved: ``slabs`` (the product) and ``whole`` (the same code
with ``SLAB_BYTES`` above every tensor, so each is read, cast and written whole: the baseline). One
line per run, then ``{"big": ..., "<command>_rss_vs_whole": ...}``. At 1 GiB the whole diff met the
OOM killer on a 24 GiB machine, hence the default.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import common
from common import emit, measure, output_dir, remove

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
RSS_SLACK_BYTES = 300 << 20

# The format_utils baseline, run as `python -c FORMAT_UTILS SEED OUTPUT_FILE`.
FORMAT_UTILS = """
import sys
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

dcp_to_torch_save(sys.argv[1], sys.argv[2])
"""


def main() -> None:
    parser = common.parser(__doc__)
    parser.add_argument(
        "--skip-format-utils",
        action="store_true",
        help="do not run format_utils.dcp_to_torch_save (it holds the whole model in RAM)",
    )
    parser.add_argument("--big", action="store_true", help="peak RSS of one large tensor: slabs vs whole")
    parser.add_argument("--big-mib", type=int, default=256, help="the large tensor's MiB with --big (default 256)")
    opts = parser.parse_args()
    with output_dir(opts.out_dir, "seedckpt-convert-bench-") as out_dir:
        (run_big if opts.big else run_all)(opts, out_dir)


def run_all(opts: argparse.Namespace, out_dir: Path) -> None:
    labels = {"benchmark": "convert", "flavor": opts.flavor}
    seed_dir, hf_dir, dcp_dir, cp_dir = (out_dir / name for name in ("seed", "hf", "dcp", "cp"))

    def run(impl: str, output: Path, cmd: list[str]) -> dict:
        remove(output)
        return measure(cmd, output, **labels, impl=impl)

    emit(
        run(
            "setup_seed",
            seed_dir,
            [
                sys.executable,
                "create_seed_checkpoint.py",
                "--config",
                "configs/debug.toml",
                "--model.flavor",
                opts.flavor,
                "--output",
                str(seed_dir),
                "--quiet",
            ],
        )
    )
    bound = rss_bound_bytes(seed_dir)
    cp = run("cp", cp_dir, ["cp", "-r", str(seed_dir), str(cp_dir)])
    emit(cp)
    cli = [sys.executable, "-m", "seedckpt.cli.main", "convert"]
    to_hf = run("dcp_to_hf", hf_dir, [*cli, str(seed_dir), str(hf_dir), "--to", "hf", "--quiet"])
    emit({**to_hf, **within(to_hf, bound), "throughput_vs_cp": to_hf["gb_per_s"] / cp["gb_per_s"]})
    to_dcp = run("hf_to_dcp", dcp_dir, [*cli, str(hf_dir), str(dcp_dir), "--to", "dcp", "--quiet"])
    emit({**to_dcp, **within(to_dcp, bound)})

    format_utils = None
    if not opts.skip_format_utils:
        fu_file = out_dir / "format_utils.pt"
        format_utils = run("format_utils", fu_file, [sys.executable, "-c", FORMAT_UTILS, str(seed_dir), str(fu_file)])
        emit(format_utils)
    emit(
        {
            **labels,
            "dcp_to_hf_throughput_vs_cp": to_hf["gb_per_s"] / cp["gb_per_s"],
            "dcp_to_hf_rss_gib": to_hf["peak_rss_gib"],
            "format_utils_rss_gib": format_utils["peak_rss_gib"] if format_utils else None,
        }
    )


# The baseline of --big: the product with slabs larger than any tensor, so every tensor is one slab.
WHOLE = """
import sys
import seedckpt.checkpoint.load as load
from seedckpt.cli.main import main

load.SLAB_BYTES = 1 << 62
sys.exit(main(sys.argv[1:]))
"""


def run_big(opts: argparse.Namespace, out_dir: Path) -> None:
    """Each command on one large tensor, ``whole`` then ``slabs``; the ratio of their peak RSS."""
    labels = {"benchmark": "convert", "big_mib": opts.big_mib}
    seed, hf = out_dir / "seed", out_dir / "hf"
    vocab = opts.big_mib * 2**20 // (128 * 4)  # float32 rows of the debug model's 128 values
    model = ["--model.vocab_size", str(vocab), "--model.n_layers", "1", "--model.tie_word_embeddings", "true"]
    emit(measure([sys.executable, "-m", "seedckpt.cli.main", "seed", "--config", "configs/debug.toml",
                  "--output", str(seed), "--quiet", *model], seed, **labels, impl="setup_seed"))  # fmt: skip
    commands = {
        "dcp_to_hf": (hf, ["convert", str(seed), str(hf), "--to", "hf", "--quiet"]),
        "hf_to_dcp": (out_dir / "dcp", ["convert", str(hf), str(out_dir / "dcp"), "--to", "dcp", "--quiet"]),
        "dcp_to_safetensors": (
            out_dir / "m.safetensors",
            ["convert", str(seed), str(out_dir / "m.safetensors"), "--to", "safetensors", "--quiet"],
        ),  # fmt: skip
        "diff": (hf, ["diff", str(seed), str(hf)]),
        "verify": (hf, ["verify", str(hf), "--quiet"]),
    }
    ratios = {}
    for name, (output, argv) in commands.items():
        runs = {}
        for impl, head in (("whole", ["-c", WHOLE]), ("slabs", ["-m", "seedckpt.cli.main"])):
            if argv[0] == "convert":
                remove(output) if output.is_dir() else output.unlink(missing_ok=True)
            runs[impl] = measure([sys.executable, *head, *argv], output, **labels, command=name, impl=impl)
            emit(runs[impl])
        ratios[f"{name}_rss_vs_whole"] = runs["slabs"]["peak_rss_gib"] / runs["whole"]["peak_rss_gib"]
    emit({**labels, **ratios})


def rss_bound_bytes(seed_dir: Path) -> int:
    """2 x the largest tensor's bytes (from the seed's manifest) + RSS_SLACK_BYTES."""
    tensors = json.loads((seed_dir / "seedckpt.json").read_text())["tensors"]
    largest = max(DTYPE_BYTES[t["dtype"]] * math.prod(t["shape"]) for t in tensors.values())
    return 2 * largest + RSS_SLACK_BYTES


def within(record: dict, bound: int) -> dict:
    return {"rss_bound_gib": bound / 2**30, "rss_within_bound": record["peak_rss_gib"] * 2**30 <= bound}


if __name__ == "__main__":
    main()
