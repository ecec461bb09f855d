"""The caller library's former name, kept so that callers written against it keep working.

Import `shardrouter.client` instead: this alias re-exports its public names and warns once.
"""

import warnings

from shardrouter.client import *  # noqa: F403 - exactly shardrouter.client's public names
from shardrouter.client import __all__ as __all__

warnings.warn(
    "the shardclient package is now shardrouter.client; import that instead",
    DeprecationWarning,
    stacklevel=2,
)
