"""Generated stubs of the shard-to-shard API (`shardrouter.internal.v1`); not for callers."""
