"""The benchmark harness: pgbench baselines, the shard, the router and the idempotency paths
measured in one run against one fresh, durable PostgreSQL. Run it with `python -m bench` (bench/README.md).
"""
