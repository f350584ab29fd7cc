"""``python -m pgonce`` is the ``pgonce`` command."""

import sys

from pgonce.cli import main

sys.exit(main())
