"""`python -m fuzz.cli …` is `llmfuzz …`."""
import sys

from fuzz.cli.main import console_main

sys.exit(console_main())
