"""``python -m engine ...`` — the same as ``kvrouter engine ...``."""

import sys

from engine.cli import main

sys.exit(main())
