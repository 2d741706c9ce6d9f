"""Attention on sequence-sharded DTensors: the sequence layout (contiguous or head-tail) and the
exact context-parallel computation the sdpa rule runs when q, k and v are ``Shard(seq)``."""
