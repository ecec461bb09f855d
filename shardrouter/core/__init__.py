"""The foundation every part of shard-router stands on; it imports nothing of the project above it.

Wire vocabulary (`keys`, `callers`, `errors`, `validation`), the shard map (`shardmap`, followed by
`shardmap_file`), gRPC plumbing shared by the threaded shard daemon and the asyncio router
(`grpcserver`, `interceptors`, `error_interceptor`, `tls`, `termination`), configuration
(`settings_source`), logs, metrics and tracing.
"""
