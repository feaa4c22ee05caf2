"""What a catalog holds: folder trees, CSV/TSV manifests and Fashion-MNIST's IDX files, as listings.
Imports no other data room: listing a catalog reads no image and no store."""
