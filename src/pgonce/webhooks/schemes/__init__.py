"""Signature schemes, one small module each; every one implements :class:`~.base.Scheme`."""
