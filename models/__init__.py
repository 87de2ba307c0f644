"""Models: pure PyTorch modules (no distributed code, no checkpoint I/O), each with its spec
(``spec``: class, flavors, tied weights) and its state-dict name adapters for other tools' layouts
(``llama_hf``, ``llama_torchtitan``). The bottom layer: nothing here imports ``seedckpt``."""
