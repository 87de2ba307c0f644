"""Parallelism: the pipeline split (``pipeline``), the mesh and what is applied per stage module --
activation checkpointing, compile, FSDP2, tied embeddings across stages (``parallelize``) -- the
data-parallel implementations (``data_parallel``: FSDP2 or ``manual_fsdp``) and collective timing
(``collectives``)."""
