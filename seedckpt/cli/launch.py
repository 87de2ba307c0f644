"""``seedckpt launch``: torchrun, whose failures end in one line instead of a traceback.

torchrun reports a failed worker by raising ``ChildFailedError`` out of its own ``main``: a Python
traceback and a forty-line summary, printed after the worker has already said in one line what
went wrong (``train.py`` does: ``rank_failures``), and exit status 1 whatever the worker's was.
A Ctrl-C ends in a ``SignalException`` traceback. This command is torchrun itself -- its argument
parser, its rendezvous and its agent (``torch.distributed.run``), so every torchrun option and
environment variable works as documented -- with only the ending changed:

* a worker that exited with a status keeps it (2: an error, 130: interrupted) and its own line is
  the report; a status other than those two (a crash with its traceback above) is named once;
* a worker killed by a signal (the kernel's out-of-memory killer sends SIGKILL) is named in one
  line, since it could not say anything itself;
* Ctrl-C stops the workers as torchrun does, and exits 128 + signal; SIGTERM, SIGUSR1 and SIGUSR2
  (a scheduler's warning) are passed on to the workers, which save their step and stop
  (``checkpoint.save_on_signals``), within torchrun's grace before it kills them;
* a rendezvous that fails (fewer nodes than ``--nnodes`` joined in time) is one line, exit 2, and
  so is losing it mid-run: the c10d store lives in one node's agent, so when that node stops or is
  killed the others' agents lose it, stop their workers and end here;
* torch's C++ warnings (``TORCH_CPP_LOG_LEVEL``, unless set) are left out: a lost store prints each
  failed socket call with a 30-frame stack before the agent raises;
* ``kill -9`` of this command kills its workers too (``train.py`` asks for the kernel's parent-death
  signal: ``seedckpt.utils.agent``), instead of leaving them training and writing checkpoints.
"""

from __future__ import annotations

import logging
import os
import signal
import sys

from seedckpt.utils.agent import AGENT_PID_ENV

# Statuses a worker reports with its own line (``rank_failures``; a stop on one of
# ``checkpoint.save_on_signals`` after saving): nothing to add to them.
_SELF_REPORTED = (2, 130, *(128 + s for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)))
# The signals the agent passes on to its workers: torchrun's, and the user signals schedulers send
# ahead of a preemption (Slurm's --signal=USR1@90), which would otherwise end the agent alone.
_FORWARDED_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1,SIGUSR2"


def main(argv: list[str]) -> int:
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # read when torch loads, just below
    os.environ.setdefault("TORCHELASTIC_SIGNALS_TO_HANDLE", _FORWARDED_SIGNALS)
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousError
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError
    from torch.distributed.run import get_args_parser, run

    parser = get_args_parser()
    parser.prog = "seedckpt launch"
    parser.description = (
        "torchrun, with one line per failure: takes torchrun's arguments, e.g. "
        "seedckpt launch --standalone --nproc-per-node 4 train.py --config configs/debug.toml"
    )
    args = parser.parse_args(argv)
    os.environ[AGENT_PID_ENV] = str(os.getpid())  # the workers check they are still this agent's (die_with_agent)
    # The agent logs each failed and stopped worker and each signal it forwards (ERROR / WARNING lines
    # with pids); the worker's own line and the ones below say it once. Each of torchelastic's
    # loggers sets its own level when its module is imported, as the ones above just were.
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed.elastic"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        run(args)
    except ValueError as e:  # torchrun's own option checks (e.g. --nproc-per-node two), before any worker
        print(f"seedckpt launch: {e}; see seedckpt launch --help", file=sys.stderr)
        return 2
    except RendezvousConnectionError:
        print(
            "seedckpt launch: lost the job's rendezvous store at --rdzv-endpoint (it lives in one node's agent: "
            "that node stopped or was killed); this node's workers were stopped -- run the same command on "
            "every node again to resume from the newest checkpoint",
            file=sys.stderr,
        )
        return 2
    except RendezvousError as e:  # e.g. fewer nodes joined than --nnodes before the timeout
        print(f"seedckpt launch: rendezvous failed: {e}", file=sys.stderr)
        return 2
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        if failure.exitcode < 0:
            name = signal.Signals(-failure.exitcode).name
            why = " (the out-of-memory killer sends it)" if failure.exitcode == -signal.SIGKILL else ""
            print(
                f"seedckpt launch: rank {rank} was killed by {name}{why}; the other ranks were stopped", file=sys.stderr
            )
            return 128 - failure.exitcode
        if failure.exitcode not in _SELF_REPORTED:
            print(
                f"seedckpt launch: rank {rank} exited with status {failure.exitcode} (its output above says "
                "why); the other ranks were stopped",
                file=sys.stderr,
            )
        return failure.exitcode
    except SignalException as e:  # Ctrl-C or a scheduler's SIGTERM: the workers were sent it too
        return 128 + int(e.sigval)
    return 0
