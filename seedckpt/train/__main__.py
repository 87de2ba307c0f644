"""``python -m seedckpt.train``: the same as ``train.py``."""

import sys

from seedckpt.train.trainer import main

sys.exit(main())
