"""Mixture of experts across ranks: expert parallelism, experts sharded over ``ep`` ranks with all-to-all token
dispatch (``expert_parallel.py``)."""
