"""Reading a prepared store for training and evaluation: sampling, host loaders, device transforms and
device-side JPEG decode. May import `store` (and `sources`, `ingest`, `splits`), nothing after it."""
