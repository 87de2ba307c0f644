"""Save and stop on a scheduler's signal: Slurm's ``--signal=USR1@90``, Kubernetes' and Slurm's
SIGTERM before the kill.

A signal handler only records the signal: the step in progress finishes, and the ranks agree to
stop through the all-reduce every step already makes (a signal may reach the ranks at different
moments, or only some of them). The trainer then saves ``step-N`` -- or waits for the asynchronous
save in flight and saves the step -- and exits with 128 + the signal's number. A second signal
changes nothing: the save already under way completes, or its temporary directory is removed.
"""

from __future__ import annotations

import signal


class SaveOnSignals:
    """The first of ``names`` received (``signum``, 0 until then), caught from construction on."""

    def __init__(self, names):
        self.signum = 0
        for name in names:
            signal.signal(signal.Signals[name], self._record)

    def _record(self, signum, frame) -> None:
        self.signum = self.signum or signum

    @staticmethod
    def name(signum: int) -> str:
        return signal.Signals(signum).name
