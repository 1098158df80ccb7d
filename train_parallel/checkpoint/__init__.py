"""Weights in and out of a run: sharded training checkpoints (``checkpoint.py``) read without running anything
stored in them (``checkpoint_reader.py``), a model dir's weights as the starting point (``init_from.py``), and LoRA
adapters in PEFT's format (``peft_format.py``)."""
