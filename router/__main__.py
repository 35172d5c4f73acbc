"""``python -m router [serve] [flags]``: the router service (same flags as ``kvrouter serve``)."""

import sys

from router.cli import main

if __name__ == "__main__":
    argv = sys.argv[1:]
    if argv[:1] == ["serve"]:  # tolerate the sub-command word
        argv = argv[1:]
    sys.exit(main(argv))
