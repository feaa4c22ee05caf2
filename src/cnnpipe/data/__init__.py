"""The data's way, room by room: `sources` (what a catalog holds) -> `ingest` (each file read once) ->
`splits` (each image's split, for good) -> `store` (the prepared format, written and swapped in) ->
`loaders` (read for training and evaluation); `prepare` and `report` walk the stage through them.

Imports run one way (tests/test_imports.py): a room imports only the rooms before it in
`sources, store, ingest, splits, loaders`. The store's format sits under ingest and splits because
each week's ingest and splits read last week's store.
"""
