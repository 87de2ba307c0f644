"""Pretrain from a seed checkpoint with pipeline parallel x FSDP2.

torchrun --nproc-per-node 4 train.py --config configs/debug.toml [--section.key value ...]
"""

import os
import sys

# Transparent huge pages for torch's large CPU allocations (read before torch first allocates): a
# CPU rank materializing a 1B stage faults its shards in 2 MiB pages instead of 4 KiB ones.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

from seedckpt.train.trainer import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
