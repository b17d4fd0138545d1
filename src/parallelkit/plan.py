"""``python -m parallelkit.plan``: the planner's ranking (``strategy=auto``) and the per-rank dry run of a layout.

The command lives in :mod:`parallelkit.tools.plan`; this module keeps its public name.
"""

import sys

from parallelkit.tools.plan import main

if __name__ == "__main__":
    sys.exit(main())
