"""The runnable service: configuration, the ASGI app and the background loops of `serve`.

It needs the ``server`` extra: ``pip install 'pgonce[server]'``.
"""

from pgonce.extras import require

require("server", "the pgonce service")
