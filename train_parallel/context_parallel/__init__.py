"""Context parallelism: the sequence split over ranks (``context_parallel.py``), with attention computed across
them by ring attention (``ring_attention.py``) or Ulysses all-to-all (``ulysses.py``)."""
