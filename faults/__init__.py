"""pgonce's fault and bad-input suite: `make faults` writes faults/results/latest.md."""
