"""`shard-router check`: drive a workload through a router, record every attempt and answer, and
prove from that history and the shard databases that every operation took effect exactly once."""
