"""The configs, shipped inside the installed package as ``parallelkit.conf`` (see setup.py).

This file only makes ``conf/`` a regular package: Hydra's ``pkg://`` config source checks for an
``__init__.py`` (and setuptools' editable finder resolves a mapped package by it), so without it the
``parallelkit`` command would find no configs.
"""
