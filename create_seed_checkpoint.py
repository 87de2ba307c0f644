"""Create a seed checkpoint on CPU: same as `seedckpt seed`.

python create_seed_checkpoint.py --config configs/debug.toml --output seeds/debug
"""

import sys

from seedckpt.cli.main import run

if __name__ == "__main__":
    run(["seed", *sys.argv[1:]])
