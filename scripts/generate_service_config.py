"""Rewrite `shardrouter/client/service_config.json` from the RPC declarations (after editing a .proto).

The caller library builds the same config at run time (`shardrouter.client.load_service_config`); the
file is its copy for clients in other languages, and `tests/client/test_service_config.py` fails when
it is stale. One command: `.venv/bin/python scripts/generate_service_config.py`.
"""

from __future__ import annotations

from shardrouter.client.service_config import write_service_config


def main() -> None:
    """Write the file and say where."""
    print(f"wrote {write_service_config()}")


if __name__ == "__main__":
    main()
