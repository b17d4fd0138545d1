"""Datamodules: ``chars`` (real text), ``synthetic`` (seeded regression)."""
