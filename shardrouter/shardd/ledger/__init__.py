"""Accounts, ledger entries, transfers and the outbox of one shard: `store` (SQL) and `service` (RPCs)."""
