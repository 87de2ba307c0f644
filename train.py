"""Pretrain from a seed checkpoint with pipeline parallel x FSDP2.

torchrun --nproc-per-node 4 train.py --config configs/debug.toml [--section.key value ...]
"""

import os
import signal
import sys

# Transparent huge pages for torch's large CPU allocations (read before torch first allocates): a
# CPU rank materializing a 1B stage faults its shards in 2 MiB pages instead of 4 KiB ones.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

if __name__ == "__main__":
    from seedckpt.utils.agent import die_with_agent

    die_with_agent()  # under torchrun: a worker whose agent is killed (kill -9) does not train on alone
    # Ctrl-C while torch loads is only noted, then answered with one line (from rank 0): raised as
    # an exception inside an import, it can be caught there and lost, and the run would go on.
    interrupted: list[int] = []
    signal.signal(signal.SIGINT, lambda signum, frame: interrupted.append(signum))
    from seedckpt.train.trainer import main

    if interrupted:
        if os.environ.get("RANK", "0") == "0":
            print("train.py: interrupted while starting; nothing was written", file=sys.stderr)
        sys.exit(130)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.exit(main())
