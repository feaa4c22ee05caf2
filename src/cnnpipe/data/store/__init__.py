"""The prepared format: sealed shards and their index, codec, metadata, keys, pins, the writer, the swap
and the previous store. May import `sources` only; every later room reads it."""
