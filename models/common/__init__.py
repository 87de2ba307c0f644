"""What the decoder families share: the decoder itself (``decoder``), the args of the Hugging Face
families (``args``), HF's tensor names (``hf_names``) and ``config.json`` reading (``hf_config``).
``decoder_family`` fills a ``ModelFamily`` with the decoder's hooks, so a family built on it states
only what is its own: args, flavors, and its ``config.json`` both ways."""

from __future__ import annotations

import torch

from models.common.args import MOE_SHAPE_FIELDS, SHAPE_FIELDS
from models.common.decoder import Transformer, tied_weights
from models.common.hf_names import ExpertNames, HFNames
from models.common.moe import moe_modules
from models.common.tensor_parallel import DECODER_TENSOR_PARALLEL
from models.family import HFAdapter, LayerCosts, ModelFamily, attended_keys, decoder_flops_per_token

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
    names=HFNames,
    **hooks,
) -> ModelFamily:
    """A family on the shared decoder: ``args`` (its dataclass) and ``flavors``, the
    ``config.json`` ``model_types`` it reads, ``config(args, dtype)`` and ``args_from_config(cfg)``;
    ``names``: args -> its HF name adapter; ``hooks``: any other ``ModelFamily`` field (``renamings``,
    ``flops_per_token``, ``layer_flops``, ``tensor_parallel``, ``osft_targets``)."""
    hooks = {
        "osft_targets": OSFT_TARGETS,
        "flops_per_token": lambda model_args, seq_len, num_params=None: decoder_flops_per_token(
            Transformer, model_args, seq_len, num_params
        ),
        "layer_flops": decoder_layer_flops,
        "tensor_parallel": DECODER_TENSOR_PARALLEL,
        **hooks,
    }
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
        hf=HFAdapter(model_types, names, config, args_from_config),
        **hooks,
    )


def moe_decoder_family(
    name: str, args: type, flavors: dict, model_types, config, args_from_config, experts: ExpertNames, **hooks
):
    """A family on the shared decoder with mixture-of-experts layers (``args``: a
    ``MoEDecoderArgs``): HF's names for its experts (``experts``), FLOPs of the active parameters.
    The decoder's TP plan covers it: attention and dense layers split, mixtures of experts whole on
    every TP rank (or split over them by expert parallelism); a family whose name adapter is more
    than that passes its own (``names``)."""
    hooks.setdefault("names", lambda model_args: HFNames(model_args, experts))
    return decoder_family(
        name,
        args,
        flavors,
        model_types,
        config,
        args_from_config,
        shape_fields=MOE_SHAPE_FIELDS,
        flops_per_token=moe_flops_per_token,
        **hooks,
    )


def moe_flops_per_token(args, seq_len: int, num_params: int | None = None) -> int:
    """The decoder's FLOPs per token counting only the parameters a token uses: each MoE layer's
    router, shared experts and ``top_k`` routed experts of ``n_experts`` (MFU of a mixture of
    experts is against its active size)."""
    if num_params is None:
        with torch.device("meta"):
            num_params = sum(p.numel() for p in Transformer(args).parameters())
    options = args.decoder_options
    moe = options.moe
    idle = len(options.moe_layers) * (moe.n_experts - moe.top_k) * moe.expert_numel(args.dim)
    return decoder_flops_per_token(Transformer, args, seq_len, num_params - idle)


def attention_flops(args, layer: int, seq_len: int) -> int:
    """Training FLOPs per token of one layer's attention: q·k and weights·v, 2·H·Q·K each forward,
    three times that with the backward (torchtitan's count), over the K keys a query attends to
    (``attended_keys``: the sequence, or a sliding-window layer's window)."""
    return 12 * args.n_heads * args.head_dim * attended_keys(args, layer, seq_len)


def decoder_layer_flops(args, seq_len: int, model=Transformer, attention=attention_flops) -> LayerCosts:
    """What each part of the decoder ``model(args)`` costs a token in training (``LayerCosts``):
    6 FLOPs per parameter a token uses, plus ``attention(args, layer, seq_len)`` in each block.
    The embedding is a lookup: 0. The output projection's matmul is the last stage's (a tied
    matrix too). A mixture of experts counts its router, any shared experts and ``top_k`` of its
    routed experts. Parameters are counted on ``meta``, so a family on this decoder (another
    attention, other experts) passes its ``model`` and its ``attention`` count and needs no formula."""
    with torch.device("meta"):
        built = model(args)
    blocks = tuple(6 * active_parameters(block) + attention(args, int(i), seq_len) for i, block in built.layers.items())
    return LayerCosts(first=0, blocks=blocks, last=6 * (parameters(built.norm) + parameters(built.output)))


def parameters(module) -> int:
    return sum(p.numel() for p in module.parameters())


def active_parameters(module) -> int:
    """The parameters of ``module`` one token uses: all, less the routed experts it is not sent to."""
    idle = sum(
        parameters(moe.experts) // moe.options.n_experts * (moe.options.n_experts - moe.options.top_k)
        for moe in moe_modules(module)
    )
    return parameters(module) - idle
