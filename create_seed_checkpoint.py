"""Create a seed checkpoint on CPU: same as `seedckpt seed`.

python create_seed_checkpoint.py --config configs/debug.toml --output seeds/debug
"""

import sys

from seedckpt.cli.main import main
from seedckpt.materialize.seed import exit_now

if __name__ == "__main__":
    exit_now(main(["seed", *sys.argv[1:]]))
