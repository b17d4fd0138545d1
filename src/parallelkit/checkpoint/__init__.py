"""``python -m parallelkit.checkpoint``: inspect a checkpoint of any layout, and convert it offline tensor by tensor.

See :mod:`parallelkit.checkpoint.cli`; :mod:`.sources` reads any checkpoint lazily, :mod:`.writers` writes one file
or a sharded directory one tensor at a time.
"""
