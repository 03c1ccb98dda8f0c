"""The stop flag: how SIGINT/SIGTERM reach a campaign, a shrink and a selftest.

Set by the CLI's signal handler next to the KeyboardInterrupt it raises. The exception alone
can be lost: a signal that lands inside a gc callback (Hypothesis >= 6.170 installs one) or
a __del__ is printed as "Exception ignored" and dropped, and the campaign ran on to its
budget. Every example and shrink step checks the flag, so a lost interrupt costs at most
one Case; selftest checks it between faults.
"""
from __future__ import annotations

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
