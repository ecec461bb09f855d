"""shard-router: shared parts of the router, the shard daemons and the caller library.

Generated API stubs live in `shardrouter.v1` (public) and `shardrouter.internal.v1` (shard to shard).
"""
