"""Model definitions. Pure PyTorch modules: no distributed code and no checkpoint I/O."""
