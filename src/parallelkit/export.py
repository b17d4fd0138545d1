"""``python -m parallelkit.export CKPT OUT_DIR``: a checkpoint of any strategy and world size → a ``save_pretrained``
directory.

The command lives in :mod:`parallelkit.tools.export`; this module keeps its public name.
"""

import sys

from parallelkit.tools.export import main

if __name__ == "__main__":
    sys.exit(main())
