"""``python -m parallelkit.verify``: does this configuration train like one process, step by step?

The command lives in :mod:`parallelkit.tools.verify`; this module keeps its public name.
"""

import sys

from parallelkit.tools.verify import main

if __name__ == "__main__":
    sys.exit(main())
