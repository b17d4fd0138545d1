"""The one thing pyproject.toml cannot say: ship ``conf/`` inside the package, as ``parallelkit.conf``.

``conf/`` stays at the top of the repository (``python train.py`` and the tests read it there) and is the
only copy of the configs; ``package-dir`` in pyproject.toml maps the package ``parallelkit.conf`` onto it.
But a mapped package must also be listed, and pyproject's ``packages.find`` only lists what it finds under
``src/``, while a static ``packages = [...]`` would silently drop every new subpackage or config group.
"""

from setuptools import find_namespace_packages, setup

# Namespace-aware, as pyproject's find was: a subpackage without an __init__.py is still shipped.
code = find_namespace_packages(where="src", include=["parallelkit", "parallelkit.*"])
# The config groups (conf/model/, ...) hold only YAML, but setuptools warns about every data directory inside
# a package that is not itself listed as one ("Package would be ignored"): list them too.
configs = ["parallelkit.conf", *(f"parallelkit.conf.{group}" for group in find_namespace_packages(where="conf"))]
# The examples (the README's own model and LightningModule), for `parallelkit examples DIR` after a pip install.
examples = ["parallelkit.examples", *(f"parallelkit.examples.{sub}" for sub in find_namespace_packages(where="examples"))]
setup(packages=[*code, *configs, *examples])
