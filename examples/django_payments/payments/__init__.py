"""The payments app of the Django example."""
