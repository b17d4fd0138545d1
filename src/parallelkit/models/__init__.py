"""Single-device models; each has a ``parallelize.py`` beside it holding its parallel plans."""
