"""Webhook edges: signature schemes (``schemes/``), the receiving ASGI app and the inbox workers."""
