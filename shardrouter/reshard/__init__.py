"""Online resharding: move a slot range, with its accounts' rows and idempotency records, from the
shard that owns it to another while traffic flows (`shard-router reshard`).

Above the shard daemon (it drives shard databases and their fences), below the local cluster.
`docs/resharding.md` describes the protocol; `move.py` runs it, one phase at a time, from the
journal it keeps in the old owner's database.
"""
