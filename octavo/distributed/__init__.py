"""Tensor parallelism on torch.distributed: the model's shards (layers.py) and the worker
processes that run them beside the engine (executor.py)."""
