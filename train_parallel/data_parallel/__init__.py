"""Data parallelism: DDP / ZeRO / FSDP2 (``data_parallel.py``), ZeRO-Offload (``offload.py``), one process over
every GPU with ``nn.DataParallel`` (``data_parallel_single.py``), and a parameter server (``parameter_server.py``,
its workers and run in ``ps_worker.py``); ``--dp-mode`` picks one of them as a strategy (``modes.py``)."""
