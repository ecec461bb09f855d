"""`shard-router reconcile`: compare what the shards' databases say about each other, report every
mismatch with what to do, and repair what is safely repairable through the daemons' own paths.

Above the shard daemon (it reads and writes shard databases with the shard's own tables and keys),
beside `reshard`; see `docs/runbooks/restore-one-shard.md`.
"""
