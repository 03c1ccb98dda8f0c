"""`python -m fuzz.report …`: see fuzz.report.render."""
import sys

from fuzz.report.render import main

sys.exit(main())
