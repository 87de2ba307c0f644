"""seedckpt: seed checkpoints and stage-wise materialization for pipeline x FSDP2 training.

``from seedckpt import load_model``: any checkpoint of any family as its ``nn.Module``.
"""

from seedckpt.utils.version import VERSION

__version__ = VERSION


def __getattr__(name: str):
    """``load_model`` imported when first asked for, so ``import seedckpt.<module>`` (and the
    ``seedckpt`` command's start) does not import the model stack."""
    if name == "load_model":
        from seedckpt.materialize.load_model import load_model

        return load_model
    raise AttributeError(f"module 'seedckpt' has no attribute {name!r}")
