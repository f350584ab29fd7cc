"""A copy of the key store's hot path compiled with mypyc, for ``bench.client_instructions
--compiled``: what compiling it, rather than any change to its Python, would save per call.

pgonce ships pure Python. The modules below are strictly typed, so mypyc compiles them as they
are but for one class: ``wire._Settled`` subclasses ``list``, which mypyc compiles only as a
Python class (``native_class=False``), said in the copy. The rest of the once() path stays
interpreted: ``pgonce.core.outcomes`` compiles but its frozen dataclasses fail at import
(mypyc's classes have no ``object.__setattr__`` to build them with), and ``store.cursors``'
classes, subclasses of psycopg's, are refused.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pgonce

#: The once() path's own modules, as mypyc compiles them (paths under the package's parent).
HOT_PATH = ("pgonce/store/wire.py", "pgonce/store/common.py", "pgonce/store/_async/keys.py")

_FUTURE = "from __future__ import annotations\n"
_SETTLED = "class _Settled(list[PGresult]):"


@contextlib.contextmanager
def compiled_copy() -> Iterator[Path]:
    """A directory holding a copy of the ``pgonce`` package with :data:`HOT_PATH` compiled:
    put it first on ``PYTHONPATH``. Needs mypy (mypyc), setuptools and a C compiler."""
    package = Path(pgonce.__file__).parent
    with tempfile.TemporaryDirectory(prefix="pgonce-mypyc-") as tmp:
        root = Path(tmp)
        shutil.copytree(package, root / "pgonce", ignore=shutil.ignore_patterns("__pycache__"))
        wire = root / "pgonce/store/wire.py"
        text = wire.read_text()
        if _FUTURE not in text or _SETTLED not in text:
            raise RuntimeError(f"{wire.name} changed: bench/compiled.py's patch needs updating")
        text = text.replace(_FUTURE, _FUTURE + "from mypy_extensions import mypyc_attr\n", 1)
        text = text.replace(_SETTLED, "@mypyc_attr(native_class=False)\n" + _SETTLED, 1)
        wire.write_text(text)
        built = subprocess.run(
            [sys.executable, "-m", "mypyc", *HOT_PATH], cwd=root, capture_output=True, text=True
        )
        if built.returncode != 0:
            raise RuntimeError(f"mypyc failed:\n{built.stdout}{built.stderr}")
        yield root
