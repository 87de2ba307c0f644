"""The ``seedckpt`` command (``main``): seed, inspect, verify, plan, convert, diff, launch;
conversion and comparison (``convert``) and torchrun with one-line endings (``launch``)."""
