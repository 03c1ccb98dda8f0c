"""The harness's error types and exit codes: a leaf every package may import."""
from __future__ import annotations

EXIT_OK, EXIT_FAIL, EXIT_BAD_INPUT, EXIT_UNWRITTEN, EXIT_INTERRUPTED = 0, 1, 2, 3, 130
# `replay`/`minimize`: the Case fails, but not as its reproducer recorded (another property,
# or another kind of message: fuzz.campaign.reproduce.replay_verdict). Not 1: a CI job that expects a
# known bug to reproduce must not pass on a different one.
EXIT_OTHER_FAILURE = 4


class BadInput(Exception):
    """Reported as one line and exit code 2."""
