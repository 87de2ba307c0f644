"""``python -m seedckpt.cli``: the ``seedckpt`` command."""

import sys

from seedckpt.cli.main import main

sys.exit(main())
