"""shardd: the shard daemon. Owns one PostgreSQL database and enforces idempotency on every mutation."""
