"""The runnable service: configuration, the ASGI app and the background loops of `serve`."""
