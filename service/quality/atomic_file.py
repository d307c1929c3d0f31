"""Files replaced whole: a run killed while writing leaves the old file or the new one, never half of one."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from pathlib import Path


def replace_lines(path: Path, lines: Sequence[str]) -> None:
    """`path` holding `lines`, written to a temporary file beside it and moved over it: a run killed meanwhile
    leaves the old file or the new one, never half of one."""
    handle, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    temporary = Path(name)
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as out:
            out.writelines(line + "\n" for line in lines)
            out.flush()
            os.fsync(out.fileno())
        temporary.replace(path)  # os.replace: atomic within one file system
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
