"""Parallelism that needs more than sharding annotations: explicit collectives inside shard_map."""
