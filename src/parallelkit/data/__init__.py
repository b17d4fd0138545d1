"""Datamodules: ``chars`` (real text, characters), ``text`` (your own files, tokenized), ``synthetic`` (seeded
regression), ``ctr`` (click logs), ``raster`` (tiles of a large image)."""
