"""Messages both sides of the data path import: replica snapshots, hints, stream chunks."""
