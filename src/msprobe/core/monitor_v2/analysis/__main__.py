"""``python -m msprobe.core.monitor_v2.analysis ...`` = the ``msprobe-monitor`` command."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
