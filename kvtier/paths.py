"""The one user cache directory kvtier writes to (compiled loops, converted models).

`$KVTIER_CACHE_DIR` where set, else `kvtier/` under `$XDG_CACHE_HOME` or `~/.cache`.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """The directory (not created here)."""
    if os.environ.get("KVTIER_CACHE_DIR"):
        return Path(os.environ["KVTIER_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvtier"
