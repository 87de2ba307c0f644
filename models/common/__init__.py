"""What the decoder families share: the decoder itself (``decoder``), the args of the Hugging Face
families (``args``), HF's tensor names (``hf_names``) and ``config.json`` reading (``hf_config``).
``decoder_family`` fills a ``ModelFamily`` with the decoder's hooks, so a family built on it states
only what is its own: args, flavors, and its ``config.json`` both ways."""

from __future__ import annotations

from models.common.args import SHAPE_FIELDS
from models.common.decoder import Transformer, tied_weights
from models.common.hf_names import HFNames
from models.common.tensor_parallel import DECODER_TENSOR_PARALLEL
from models.family import HFAdapter, ModelFamily, decoder_flops_per_token

# The block linears OSFT trains by default: every attention and feed-forward matrix.
OSFT_TARGETS = (
    "attention.wq",
    "attention.wk",
    "attention.wv",
    "attention.wo",
    "feed_forward.w1",
    "feed_forward.w2",
    "feed_forward.w3",
)


def decoder_family(
    name: str,
    args: type,
    flavors: dict,
    model_types: tuple[str, ...],
    config,
    args_from_config,
    shape_fields: tuple[str, ...] = SHAPE_FIELDS,
    **hooks,
) -> ModelFamily:
    """A family on the shared decoder: ``args`` (its dataclass) and ``flavors``, the
    ``config.json`` ``model_types`` it reads, ``config(args, dtype)`` and ``args_from_config(cfg)``;
    ``hooks``: any other ``ModelFamily`` field (``renamings``, ``check_seq_len``)."""
    return ModelFamily(
        name=name,
        args=args,
        model=Transformer,
        flavors=flavors,
        shape_fields=shape_fields,
        tied_weights=tied_weights,
        first_stage=("tok_embeddings",),
        last_stage=("norm", "output"),
        vocab_fqns=("tok_embeddings.weight", "output.weight"),
        osft_targets=OSFT_TARGETS,
        flops_per_token=lambda model_args, seq_len, num_params=None: decoder_flops_per_token(
            Transformer, model_args, seq_len, num_params
        ),
        hf=HFAdapter(model_types, HFNames, config, args_from_config),
        tensor_parallel=DECODER_TENSOR_PARALLEL,
        **hooks,
    )
