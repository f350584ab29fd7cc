"""Framework adapters: optional, each behind its own extra, never imported by pgonce's core."""
