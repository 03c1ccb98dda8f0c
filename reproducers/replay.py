#!/usr/bin/env python3
"""Replay a reproducer from a checkout, without installing llmfuzz.

    python reproducers/replay.py FILE [--json]

Same as `llmfuzz replay FILE`: exit 1 if the case still fails as recorded, 4 if it fails with
another violation, 0 if it passes now, 2 if the file is malformed (one line on stderr). A
reproducer with a `history` runs those earlier Cases first, on the same new engine.
"""
from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)  # the checkout's engine/ and fuzz/, installed or not

from fuzz.cli.main import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["replay", *sys.argv[1:]]))
