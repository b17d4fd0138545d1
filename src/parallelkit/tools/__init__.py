"""Command-line tools that read what a run wrote (``python -m parallelkit.tools.NAME DIR``)."""
