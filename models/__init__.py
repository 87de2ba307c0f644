"""Models: pure PyTorch modules (no distributed code, no checkpoint I/O), one folder per family.

``family`` says what a family provides (its hooks), ``registry`` lists the families by
``model.name``. Each family's folder holds its args and flavors, the model, its Hugging Face
adapter, other tools' names and its ``ModelFamily``. The bottom layer: nothing here imports
``seedckpt``.
"""
