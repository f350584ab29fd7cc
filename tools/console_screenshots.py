"""Screenshots of the operator console for the docs: ``docs/assets/console/*.png``.

Runs the console's Chromium tests (tests/service/test_console_browser.py) against the real
service with ``PGONCE_CONSOLE_SCREENSHOTS`` set: the tests seed their rows, walk every page and
save each one. Needs what the tests need: ``PGONCE_TEST_DSN`` and /usr/bin/chromium.

    PGONCE_TEST_DSN=postgresql://postgres@127.0.0.1:5432/test .venv/bin/python \
        tools/console_screenshots.py
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TARGET = ROOT / "docs" / "assets" / "console"


def main() -> int:
    TARGET.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PGONCE_CONSOLE_SCREENSHOTS": str(TARGET)}
    test = "tests/service/test_console_browser.py"
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", test],
                          cwd=ROOT, env=env, check=False)  # fmt: skip
    for shot in sorted(TARGET.glob("*.png")):
        print(shot.relative_to(ROOT))
    return done.returncode


if __name__ == "__main__":
    sys.exit(main())
