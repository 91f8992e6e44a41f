"""LoRA adapters: the request that names one (request.py), reading a PEFT directory (adapter.py),
the layers that add an adapter's product to a base projection (layers.py) and the fixed slots
adapters are swapped into (slots.py)."""
