"""One module per parallel technique, each with one public ``apply_*``/``build_*`` function."""
