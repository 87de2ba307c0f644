"""Pretrain from a seed checkpoint with pipeline parallel x FSDP2.

torchrun --nproc-per-node 4 train.py --config configs/debug.toml [--section.key value ...]
"""

import os
import sys

# Transparent huge pages for torch's large CPU allocations (read before torch first allocates): a
# CPU rank materializing a 1B stage faults its shards in 2 MiB pages instead of 4 KiB ones.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

try:
    from seedckpt.train.trainer import main  # noqa: E402
except KeyboardInterrupt:  # Ctrl-C while torch loads: one line (from rank 0), not a traceback per rank
    if os.environ.get("RANK", "0") == "0":
        print("train.py: interrupted while starting; nothing was written", file=sys.stderr)
    sys.exit(130)

if __name__ == "__main__":
    sys.exit(main())
