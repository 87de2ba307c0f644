"""seedckpt: seed checkpoints and stage-wise materialization for pipeline x FSDP2 training."""

__version__ = "0.1.0"
