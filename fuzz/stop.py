"""The stop flag: how SIGINT/SIGTERM reach a campaign, a shrink and a selftest, and the
`llmfuzz` process's signal handlers that set it.

Set by the CLI's signal handler next to the KeyboardInterrupt it raises. The exception alone
can be lost: a signal that lands inside a gc callback (Hypothesis >= 6.170 installs one) or
a __del__ is printed as "Exception ignored" and dropped, and the campaign ran on to its
budget. Every example and shrink step checks the flag, so a lost interrupt costs at most
one Case; selftest checks it between faults.
"""
from __future__ import annotations

import sys
import threading

_STOP = threading.Event()


class StopRequested(KeyboardInterrupt):
    """What a stop raises: a KeyboardInterrupt (every `except KeyboardInterrupt` handles it),
    but not exactly one. CPython (3.11, 3.12) remembers a KeyboardInterrupt that leaves code
    run from a source string (`exec(str)`, `eval(str)`: Hypothesis builds its test wrappers
    that way, dataclasses their methods) even when a caller catches it, and a `python -m`
    process then ends by killing itself with SIGINT instead of exiting with its code: a
    SIGTERM'd selftest printed its faults and died of SIGINT (-2) instead of exiting 130. It
    checks for the type KeyboardInterrupt itself, so a subclass is not remembered."""


def request_stop() -> None:
    _STOP.set()


def stop_requested() -> bool:
    return _STOP.is_set()


def check_stop() -> None:
    if _STOP.is_set():
        raise StopRequested


def clear_stop() -> None:
    """A stop belongs to the run it interrupted (tests call the CLI in-process, run after run)."""
    _STOP.clear()


# -- the `llmfuzz` process's signal handlers and exit ----------------------------------------

def terminate_as_interrupt(signum, frame) -> None:
    # SIGTERM (a CI time limit, `kill`) stops a campaign the way Ctrl-C does: failures found so
    # far are already on disk, the summary so far is printed, the exit code says what was found.
    request_stop()  # in case the exception below is swallowed (see fuzz.stop)
    raise StopRequested  # not a bare KeyboardInterrupt: see fuzz.stop.StopRequested


def stop_after_command(signum, frame) -> None:
    # The command is done and the process is exiting: a signal now only sets the flag. Raising
    # would land in interpreter teardown (a traceback, or a death by SIGINT), and the default
    # SIGTERM action would kill the process before it could exit with its code.
    request_stop()


def exit_past_stuck_ranks(code: int) -> None:
    """An interrupt can catch a rank thread mid-step; if it has not unwound by now (a loaded
    machine), interpreter shutdown would meet it inside torch and abort (SIGABRT) after the
    summary was printed. Everything is on disk and flushed: leave without finalization."""
    import os
    import threading

    if is_main_thread() and any(t.is_alive() and t is not threading.current_thread()
                                   for t in threading.enumerate()):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def is_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()
