"""Pipeline parallelism: the cost-balanced stage split and torch.distributed.pipelining's schedules
(``pipeline_parallel.py``)."""
