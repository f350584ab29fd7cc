"""The async store: the source the sync store is generated from."""
