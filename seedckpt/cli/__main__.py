"""``python -m seedckpt.cli``: the ``seedckpt`` command."""

from seedckpt.cli.main import run

run()
