"""The checkpoint reader's restricted unpickler and ``getattr``: some CPython releases (3.11.2 here) pickle an Enum
member as ``getattr(EnumClass, "NAME")``, which DeepSpeed's optimizer states hold; only that form is read, never a
method of a trusted class (which a crafted file could call next)."""

from __future__ import annotations

import pathlib
import pickle

import pytest
from torch.distributed.fsdp import ShardingStrategy

from parallelkit.checkpoint.sources import _LazyUnpickler


class _ByGetattr:
    def __init__(self, owner, name):
        self.owner, self.name = owner, name

    def __reduce__(self):
        return getattr, (self.owner, self.name)


def _load(obj):
    return _LazyUnpickler(pickle.dumps({"state": obj}, protocol=2), records=None).load()


def test_an_enum_member_pickled_through_getattr_is_read():
    assert _load(_ByGetattr(ShardingStrategy, "FULL_SHARD")) == {"state": ShardingStrategy.FULL_SHARD}


@pytest.mark.parametrize("owner, name", [(pathlib.Path, "unlink"), (ShardingStrategy, "__class__"), (ShardingStrategy, "NOT_A_MEMBER")])
def test_any_other_getattr_is_refused(owner, name):
    with pytest.raises(pickle.UnpicklingError, match="only an Enum member"):
        _load(_ByGetattr(owner, name))
