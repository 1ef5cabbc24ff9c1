"""The node's hardware, in one place: what a GPU can do (``limits``: the datasheet table the
selftest judges against), how the node's GPUs are found (``devices``: CUDA, ``nvidia-smi``, a
recorded inventory) and what NVML says of them (``nvml``: topology, health, clocks). Imported by
the rank runtime, the control side and the engines alike; it imports nothing of theirs."""
