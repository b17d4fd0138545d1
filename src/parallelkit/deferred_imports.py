"""Importing Lightning without importing Hugging Face ``transformers`` on the way.

``import lightning`` imports ``torchmetrics`` whole (``lightning.fabric.utilities.imports`` compares its
version), and one of torchmetrics' modules, BERTScore's ``torchmetrics.functional.text.bert``, runs
``from transformers import AutoModel, AutoTokenizer`` at import when transformers is installed. That line
cost each rank about 1 s of CPU at start-up on the 2-core machine (``python -X importtime -c "import
lightning.pytorch"``: 1.04 s of 4.2 s), the largest share of parallelkit's whole-process overhead over a
hand-written DDP loop (``bench/overhead.py``), for a metric no parallelkit run computes.

:func:`install` (at ``import parallelkit``) adds an import hook for that module only: while it executes,
``transformers`` resolves to a placeholder whose ``AutoModel`` / ``AutoTokenizer`` are :class:`DeferredName` s
that import the real ``transformers`` on first use and forward to it, so BERTScore still works and pays the
import when it is used. Everything else sees the real package: the placeholder is in ``sys.modules`` only
while that module executes, and the hook steps aside when transformers is already imported (a Hugging Face
run, or a user's script that imported it first). Should a future torchmetrics need more from transformers at
import than the placeholder gives, the module is executed again with the real package: slower, not broken.
``tests/unit/test_deferred_imports.py`` holds each of these.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any

DEFERRED_MODULES = frozenset({"torchmetrics.functional.text.bert"})
PACKAGE = "transformers"


class DeferredName:
    """``transformers.<name>``, imported when first used (an attribute, a call)."""

    def __init__(self, name: str) -> None:
        self._name = name

    def resolve(self) -> Any:
        return getattr(importlib.import_module(PACKAGE), self._name)

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):  # copy/pickle/inspect probing the proxy itself
            raise AttributeError(attr)
        return getattr(self.resolve(), attr)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.resolve()(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<{PACKAGE}.{self._name}, imported on first use>"


class _Placeholder(types.ModuleType):
    """``transformers`` while a deferred module executes: every public name it asks for is a DeferredName."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return DeferredName(name)


class _DeferringLoader(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader) -> None:
        self._loader = loader

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename, is_package: the file's own loader's
        return getattr(self._loader, name)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        placeholder = sys.modules[PACKAGE] = _Placeholder(PACKAGE)  # the finder stepped aside if transformers was imported
        try:
            self._loader.exec_module(module)
            return
        except Exception:
            pass
        finally:
            if sys.modules.get(PACKAGE) is placeholder:
                del sys.modules[PACKAGE]
        self._loader.exec_module(module)  # it needed more than the placeholder gives: with the real package


class _DeferringFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in DEFERRED_MODULES or PACKAGE in sys.modules:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _DeferringLoader(spec.loader)
        return spec


def install() -> None:
    """Put the hook first on ``sys.meta_path`` (idempotent); it does nothing once that module is imported."""
    if not any(isinstance(f, _DeferringFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _DeferringFinder())
