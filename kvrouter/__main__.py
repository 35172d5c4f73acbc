"""``python -m kvrouter ...`` — the same as the ``kvrouter`` command."""

import sys

from kvrouter.cli import main

sys.exit(main())
