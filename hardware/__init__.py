"""Hardware as data: the GPU catalogue (gpus.toml) and its schema (catalogue.py). Pure data: no torch."""
