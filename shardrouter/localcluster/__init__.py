"""The local cluster: PostgreSQL servers from the embedded wheel, shard daemons and a router as processes."""
