"""Pretrain from a seed checkpoint with pipeline parallel x FSDP2.

    torchrun --nproc-per-node 4 train.py --config configs/debug.toml [--section.key value ...]
"""

import sys

from seedckpt.train import main

if __name__ == "__main__":
    sys.exit(main())
