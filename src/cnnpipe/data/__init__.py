"""Data ingestion (prepare), the prepared format, and the training/eval loaders."""
