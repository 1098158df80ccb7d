"""Tensor parallelism: Megatron-style 1D tensor + sequence parallelism with DTensor (``tensor_parallel.py``), and
the 2D / 2.5D / 3D grids on torch.distributed collectives (``tp_nd/``)."""
