"""Which split each image gets, for good: seeded draws, the split ledger and its rules, held-out photos.
May import `sources` and `store` (last week's ledger and store), never `ingest` or `loaders`."""
