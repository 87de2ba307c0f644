"""``python -m seedckpt.train``: the same as ``train.py``."""

import sys

from seedckpt.utils.agent import die_with_agent

die_with_agent()  # before the imports' seconds: under torchrun, the worker dies with its agent

from seedckpt.train.trainer import main  # noqa: E402

sys.exit(main())
