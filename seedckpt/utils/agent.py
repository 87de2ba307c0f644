"""A training worker dies with the agent that started it (``seedckpt launch``, torchrun).

torchrun's agent starts each worker in a session of its own (``start_new_session``), so an agent
killed with SIGKILL -- which it cannot catch, so it stops nothing -- used to leave its workers
training on and writing the checkpoint folder, with no one to collect them. Linux's parent-death
signal (``prctl(PR_SET_PDEATHSIG)``) has the kernel send the worker SIGKILL when the thread that
started it ends; torchrun's agent starts its workers from its main thread, which ends only with the
agent. SIGKILL rather than SIGTERM: with the agent gone so is the job's store, which a save on
SIGTERM (``checkpoint.save_on_signals``) could wait on forever; a write cut short publishes nothing.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

# Set by ``seedckpt launch`` to its own pid (the agent's), inherited by its workers: the parent a
# worker checks it still has once the signal is asked for.
AGENT_PID_ENV = "SEEDCKPT_AGENT_PID"
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_agent() -> None:
    """In a worker that an elastic agent started (``TORCHELASTIC_RUN_ID`` set, on Linux), ask the
    kernel for SIGKILL when the agent dies, and die now if it died first: an agent killed before
    the request is no longer the parent (``getppid`` names whoever adopted the worker). The agent
    is the one ``seedckpt launch`` names, else the parent at the request (plain torchrun). Anywhere
    else (``python train.py`` from a shell, macOS) nothing changes."""
    if not sys.platform.startswith("linux") or "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    # Popped: a process this worker starts is not the agent's worker.
    agent = int(os.environ.pop(AGENT_PID_ENV, os.getppid()))
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, ctypes.c_ulong(signal.SIGKILL), 0, 0, 0) != 0:
        return  # a kernel without it (not seen): the worker runs as it always did
    if os.getppid() != agent:
        os.kill(os.getpid(), signal.SIGKILL)
