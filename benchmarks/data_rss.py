"""Benchmark a rank's memory against the corpus size: ``data.kind = "tokens"`` reads each window with
one ``pread``, so a rank's peak RSS should not grow with the token file.

Two token directories in the format ``seedckpt tokenize`` writes (``write_token_directory``: ids,
CRC32C pieces, manifest), filled with random ids below the debug model's vocabulary -- tokenizing
gigabytes of text on a small machine would take hours and measure the tokenizer: a small one
(``--small-mib``, the baseline) and a large one (``--gib``, default 4 GiB = 1 G tokens). ``train.py``
then trains the debug model on each, one process, ``--steps`` steps, no checkpoints; each run's peak
RSS comes from ``os.wait4``. The last line compares them: ``rss_growth_mib`` (large minus small; the
target is under 300 MiB) and the corpus ratio.

  python benchmarks/data_rss.py                      # 4 GiB corpus under $TMPDIR (needs ~4.1 GB free)
  python benchmarks/data_rss.py --gib 8 --out-dir /big/disk
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from common import ROOT, emit, measure, output_dir, parser

BLOCK_TOKENS = 16 << 20  # ids generated and written per block (64 MiB)


def random_blocks(tokens: int, vocab: int, seed: int):
    """``({"tokens.bin": ids}, documents, bytes)`` blocks as ``write_token_directory`` takes them:
    random ids below ``vocab``, each block counted as one document."""
    import numpy as np

    rng = np.random.default_rng(seed)
    for start in range(0, tokens, BLOCK_TOKENS):
        n = min(BLOCK_TOKENS, tokens - start)
        yield {"tokens.bin": rng.integers(0, vocab, n, dtype=np.uint32)}, 1, n * 4


def make_corpus(path: Path, tokens: int, vocab: int) -> Path:
    sys.path.insert(0, str(ROOT))
    from seedckpt.data.token_files import write_token_directory

    return write_token_directory(path, random_blocks(tokens, vocab, seed=0), vocab, {"tokenizer": "random ids"})


def train(corpus: Path, work: Path, steps: int) -> dict:
    run = work / f"run-{corpus.name}"
    cmd = [sys.executable, "train.py", "--config", "configs/debug.toml", "--parallelism.pipeline_parallel_degree", "1"]
    cmd += ["--data.kind", "tokens", "--data.path", str(corpus), "--training.steps", str(steps)]
    cmd += ["--checkpoint.init_from", "direct"]  # no seed file: every rank initializes its own weights
    cmd += ["--checkpoint.enable", "false", "--checkpoint.folder", str(run / "ckpt"), "--job.dump_folder", str(run)]
    return measure(cmd, run / "metrics.jsonl")


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--gib", type=float, default=4.0, help="the large corpus in GiB of uint32 tokens (default 4)")
    p.add_argument("--small-mib", type=int, default=16, help="the baseline corpus in MiB (default 16)")
    p.add_argument("--steps", type=int, default=20, help="training steps per run (default 20)")
    opts = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    vocab = 512  # configs/debug.toml's vocabulary
    with output_dir(opts.out_dir, "seedckpt-data-rss-") as work:
        sizes = {"small": opts.small_mib << 20, "large": int(opts.gib * (1 << 30))}
        results = {}
        for name, nbytes in sizes.items():
            corpus = make_corpus(work / name, nbytes // 4, vocab)
            record = train(corpus, work, opts.steps)
            results[name] = {"corpus": name, "corpus_bytes": nbytes, "peak_rss_mib": record["peak_rss_gib"] * 1024}
            emit({**results[name], "train_wall_s": record["wall_s"], "steps": opts.steps})
            (corpus / "tokens.bin").unlink()  # the disk back before the next one
        growth = results["large"]["peak_rss_mib"] - results["small"]["peak_rss_mib"]
        emit(
            {
                "comparison": "large vs small corpus",
                "corpus_ratio": sizes["large"] / sizes["small"],
                "rss_growth_mib": growth,
                "within_target": growth <= 300,
            }
        )


if __name__ == "__main__":
    main()
