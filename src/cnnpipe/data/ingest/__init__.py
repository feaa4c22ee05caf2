"""Reading each catalog file once: decoding rules, the worker processes, the journal of a killed run.
May import `sources` and `store` (to reuse last week's pixels), never `splits` or `loaders`."""
