"""Benchmark a rank's memory against the corpus size: ``data.kind = "tokens"`` reads each window with
one ``pread``, so a rank's peak RSS should not grow with the token file.

Two token directories in the format ``seedckpt tokenize`` writes (``write_token_directory``: ids,
CRC32C pieces, manifest), filled with random ids below the debug model's vocabulary -- tokenizing
gigabytes of text on a small machine would take hours and measure the tokenizer: a small one
(``--small-mib``, the baseline) and a large one (``--gib``, default 4 GiB = 1 G tokens). ``train.py``
then trains the debug model on each, one process, ``--steps`` steps, no checkpoints; each run's peak
RSS comes from ``os.wait4``. A comparison line follows: ``rss_growth_mib`` (large minus small; the
target is under 300 MiB) and the corpus ratio.

Then the same for chat token directories (``seedckpt tokenize --chat``'s format: ids, label mask and
the per-conversation index), which training packs: ``--small-conversations`` (the baseline) and
``--conversations`` random conversations of 16-111 tokens, the second half of each labelled. What a
rank holds grows with the number of conversations (the index and each epoch's packing order), so
the last line gives ``rss_per_conversation_bytes``.

  python benchmarks/data_rss.py                      # 4 GiB corpus under $TMPDIR (needs ~4.1 GB free)
  python benchmarks/data_rss.py --gib 8 --out-dir /big/disk
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from common import ROOT, emit, measure, output_dir, parser, run_checked

BLOCK_TOKENS = 16 << 20  # ids generated and written per block (64 MiB)


def random_blocks(tokens: int, vocab: int, seed: int):
    """``({"tokens.bin": ids}, documents, bytes)`` blocks as ``write_token_directory`` takes them:
    random ids below ``vocab``, each block counted as one document."""
    import numpy as np

    rng = np.random.default_rng(seed)
    for start in range(0, tokens, BLOCK_TOKENS):
        n = min(BLOCK_TOKENS, tokens - start)
        yield {"tokens.bin": rng.integers(0, vocab, n, dtype=np.uint32)}, 1, n * 4


def random_conversations(count: int, vocab: int, seed: int, per_block: int = 100_000):
    """``({file: array}, conversations, bytes)`` blocks of a chat token directory: random ids, 16-111
    tokens a conversation, the second half of each labelled."""
    import numpy as np

    rng = np.random.default_rng(seed)
    for start in range(0, count, per_block):
        lengths = rng.integers(16, 112, min(per_block, count - start))
        ids = rng.integers(0, vocab, int(lengths.sum()), dtype=np.uint32)
        offsets = np.arange(len(ids)) - np.repeat(np.cumsum(lengths) - lengths, lengths)  # position in its conversation
        mask = (offsets >= np.repeat(lengths // 2, lengths)).astype(np.uint8)
        index = np.stack([lengths, lengths // 2], axis=1).astype(np.uint32)
        yield {"tokens.bin": ids, "mask.bin": mask, "documents.bin": index}, len(lengths), ids.nbytes


def write_corpus(kind: str, path: Path, count: int, vocab: int) -> None:
    """Write a token directory of ``count`` random tokens (``kind`` "text") or conversations ("chat")."""
    sys.path.insert(0, str(ROOT))
    from seedckpt.data.token_files import CHAT_FILES, TOKENS_FILE, write_token_directory

    if kind == "chat":
        meta = {"content": "chat", "tokenizer": "random ids", "pad_token_id": 0}
        write_token_directory(path, random_conversations(count, vocab, 0), vocab, meta, names=CHAT_FILES)
    else:
        write_token_directory(
            path, random_blocks(count, vocab, 0), vocab, {"tokenizer": "random ids"}, names=(TOKENS_FILE,)
        )


def make_corpus(kind: str, path: Path, count: int, vocab: int) -> Path:
    """``write_corpus`` in a child process: this one stays free of torch and of the corpus's blocks,
    which would otherwise floor the training runs' ``ru_maxrss`` (a child's starts at its parent's
    peak)."""
    run_checked([sys.executable, __file__, "--write", kind, str(path), str(count), str(vocab)], f"writing {path}")
    return path


def train(corpus: Path, work: Path, steps: int) -> dict:
    run = work / f"run-{corpus.name}"
    cmd = [sys.executable, "train.py", "--config", "configs/debug.toml", "--parallelism.pipeline_parallel_degree", "1"]
    cmd += ["--data.kind", "tokens", "--data.path", str(corpus), "--training.steps", str(steps)]
    cmd += ["--checkpoint.init_from", "direct"]  # no seed file: every rank initializes its own weights
    cmd += ["--checkpoint.enable", "false", "--checkpoint.folder", str(run / "ckpt"), "--job.dump_folder", str(run)]
    return measure(cmd, run / "metrics.jsonl")


def main() -> None:
    if sys.argv[1:2] == ["--write"]:  # make_corpus's child
        kind, path, count, vocab = sys.argv[2:]
        return write_corpus(kind, Path(path), int(count), int(vocab))
    p = parser(__doc__)
    p.add_argument("--gib", type=float, default=4.0, help="the large corpus in GiB of uint32 tokens (default 4)")
    p.add_argument("--small-mib", type=int, default=16, help="the baseline corpus in MiB (default 16)")
    p.add_argument("--steps", type=int, default=20, help="training steps per run (default 20)")
    p.add_argument("--conversations", type=int, default=1_000_000, help="the large chat corpus (default 1M)")
    p.add_argument("--small-conversations", type=int, default=10_000, help="the chat baseline (default 10k)")
    opts = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    vocab = 512  # configs/debug.toml's vocabulary
    with output_dir(opts.out_dir, "seedckpt-data-rss-") as work:
        sizes = {"small": opts.small_mib << 20, "large": int(opts.gib * (1 << 30))}
        results = {}
        for name, nbytes in sizes.items():
            corpus = make_corpus("text", work / name, nbytes // 4, vocab)
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
        chats = {"chat-small": opts.small_conversations, "chat-large": opts.conversations}
        for name, count in chats.items():
            corpus = make_corpus("chat", work / name, count, vocab)
            record = train(corpus, work, opts.steps)
            results[name] = {"corpus": name, "conversations": count, "peak_rss_mib": record["peak_rss_gib"] * 1024}
            emit({**results[name], "train_wall_s": record["wall_s"], "steps": opts.steps})
        growth = results["chat-large"]["peak_rss_mib"] - results["chat-small"]["peak_rss_mib"]
        emit(
            {
                "comparison": "large vs small chat corpus",
                "conversations_ratio": opts.conversations / opts.small_conversations,
                "rss_growth_mib": growth,
                "rss_per_conversation_bytes": growth * 2**20 / (opts.conversations - opts.small_conversations),
            }
        )


if __name__ == "__main__":
    main()
