"""Sharding decisions: the rule vocabulary, the one registry of op entries, and the propagator.

- ``registry``: ``OpCall``, ``OpStrategy``, ``Rule`` and the ``REGISTRY`` every op family fills;
- ``entry``: ``OpEntry``, what the registry knows about one aten overload;
- ``propagator``: picks the cheapest strategy for a call and says what the inputs must become;
"""
