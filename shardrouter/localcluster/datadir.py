"""Where the local cluster keeps its data unless told otherwise.

Its own module, importing nothing heavy: `shard-router reshard` reads the local cluster's files by
default, and must start where the local cluster's PostgreSQL wheel is not installed (the container
image, a Kubernetes Job).
"""

from __future__ import annotations

import os
from pathlib import Path


def default_data_dir() -> Path:
    """Where the local cluster keeps its databases unless told otherwise."""
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "shard-router" / "cluster"


__all__ = ["default_data_dir"]
