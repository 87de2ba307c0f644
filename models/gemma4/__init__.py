"""Gemma 4 (text): ``Gemma4ForCausalLM`` (model_type ``gemma4_text``) and the decoder of the released
multimodal ``gemma4`` directories (``models.gemma4.hf``).

Gemma 3's decoder (sandwich norms, q/k norms, GeGLU, the embedding times ``sqrt(dim)`` rounded to
its dtype, tied output, a final logit softcap, windowed and global layers each with its RoPE base),
and what Gemma 4 adds or changes (``models.gemma4.model``):

* every norm scales by ``weight`` (ones at init), computed in float32 -- not Gemma 3's ``1 + w``;
  attention scores are unscaled (1.0: the q/k norms set their size), and values are normed too,
  without a scale;
* the two layer kinds differ in shape: windowed layers have heads of ``head_dim`` (256) and
  ``n_kv_heads``, global layers heads of ``global_head_dim`` (512) and ``global_kv_heads``; with
  ``attention_k_eq_v`` a global layer has no ``wv`` -- its values are its keys' projection before
  the key norm and RoPE;
* global layers turn "proportional" RoPE: of a head's D/2 pairs, the first ``global_rope_fraction``
  (a quarter) turn at ``theta^(-2j/D)`` (10^6), the others not at all; windowed layers turn every
  pair at 10^4;
* per-layer inputs (``per_layer_dim`` > 0: E2B, E4B): beside the embedding, every layer's own
  ``per_layer_dim``-wide input, from a second token table and a projection of the embedding
  (``per_layer_inputs.*``); each block ends by adding ``norm(projection(gelu(gate(h)) * input))``
  (``layers.{i}.per_layer.*``) and multiplying by a stored ``layer_scalar``;
* the last ``kv_shared_layers`` layers compute no keys or values: each reuses those of the last
  layer of its kind before them (no ``wk``, ``wv``, ``k_norm``); with ``double_wide_mlp`` their MLP
  is twice as wide;
* with ``n_experts`` (26B-A4B) every block has a mixture of experts beside its MLP: routed on the
  residual by a softmax over ``norm(h) * scale * dim^-1/2`` (norm without a weight), the top ``top_k``
  renormalized and multiplied by a learned ``per_expert_scale``; its GeGLU experts take the residual
  through a norm of their own; the MLP's and the experts' outputs are each normed, summed, and
  normed again (``models.common.moe``'s block, with Gemma 4's router and expert-input norm).

Design, for pipeline parallelism and a model free of distributed code:

* the per-layer inputs are computed on the first stage, where the embedding is (``per_layer_inputs``
  is a first-stage module, as ``tok_embeddings``), and travel between stages with the hidden state,
  concatenated to it (``dim + n_layers * per_layer_dim`` wide): a stage needs no token ids and no
  copy of the second table, which is 2.35 B of E2B's 4.63 B parameters;
* a kv-shared layer takes its keys and values from the block that computed them, handed on by the
  model's loop within a stage (blocks return them; only the layers reused are kept through the
  forward, so activation checkpointing still frees the others). The layers from the first one
  reused to the last are one run a pipeline stage holds whole (``joined_layers``): the balanced split
  keeps them together, and split points that cut them are refused before training starts, naming
  the split points that do not. Sending keys and values between stages instead would tie a stage's
  inputs to the attention's head layout (and, under TP, to each rank's heads). E2B's run is layers
  13..34 of 35, so its stages but the last hold at most 13 layers;
* q/k rows are kept in transformers' order and RoPE turns halves of each head (``rotate_halves``),
  where the shared decoder permutes rows to turn interleaved pairs: with ``attention_k_eq_v`` the
  values are the keys' projection, so a permutation of the key rows would permute the values'
  channels and ``wo``'s columns with them; conversion is a renaming.

Compiled (``training.compile``), the debug flavor's losses leave eager's by 6e-4 at step 3 (5e-3 with
experts, where a near-tie has routed a token to another expert; Gemma 3's stay within 5e-7): inductor's
fused norms round an ulp off eager's, and the unscaled scores amplify any such difference -- eager
itself, every weight times 1 + 1e-7 noise, drifts 2e-3 by step 4 in float64, 1e-6 with the scores
scaled by ``head_dim^-1/2``. Through ``aot_eager``, or inductor in float64, compiled equals eager.

Layouts part the same way with experts, by rounding, not by the plan. The debug seed with experts
leaves one process's losses by 8e-8, 1.5e-7, 3e-4 over three steps on tp2 and on tp2 x dp_shard2 in
float32; in float64, tp2 stays within 3e-12 with every token routed alike (``tests/test_gemma4.py``
holds it to 1e-9). AdamW's first step moves a weight by about the learning rate whatever its
gradient's size, so an element whose gradient is near zero, its sign left to rounding, moves one way
on one layout and the other way on the other (one of layer 0's ``wq`` elements: 1.9 learning rates
apart); the unscaled scores carry that on until, by step 3, the layouts' router scores are 1e-4
apart, past a near-tie's margin (two tokens of layer 1 flip, at margins 1e-5 and 8e-5; the later
layers follow). The dense debug flavor stays within 1e-6 over the same steps; a router drawn at std
0.1 instead of 0.02 parts by 1e-4 at step 2.

Tensor names: the shared decoder's (``tok_embeddings``, ``layers.{i}.attention.{wq,wk,wv,wo}``,
``attention.{q_norm,k_norm}``, ``feed_forward.{w1,w2,w3}``, ``attention_norm``, ``post_attention_norm``,
``ffn_norm``, ``post_ffn_norm``, ``norm``, ``output``), plus ``layers.{i}.layer_scalar``,
``layers.{i}.per_layer.{gate,projection,norm}.weight``, ``per_layer_inputs.{embeddings,projection,
norm}.weight``, and with experts ``layers.{i}.moe.router.{gate.weight,scale,per_expert_scale}``,
``layers.{i}.moe.experts.{w1,w2,w3}``, ``layers.{i}.moe.expert_norm.weight``,
``layers.{i}.{post_mlp_norm,post_moe_norm}.weight``. Hugging Face's are mapped by ``hf``.

The init recipe is transformers': every weight normal with std ``initializer_range``, every norm's
weight, the router's ``scale`` and ``per_expert_scale`` and ``layer_scalar`` one. Tensor parallelism:
``models.gemma4.tensor_parallel``. FLOPs count a windowed layer's attention over its window, each
kind in its head size, the routed experts a token reaches, and the per-layer table as the lookup it
is: counted as a matmul it would add 14.1 GFLOPs a token to E2B's 15.4 at 4096 tokens (an MFU
overstated 1.9x).
"""

from __future__ import annotations

import dataclasses

import torch

from models.common import OSFT_TARGETS, decoder_family, decoder_layer_flops, parameters
from models.family import LayerCosts, attended_keys
from models.gemma4 import hf
from models.gemma4.args import SHAPE_FIELDS, Gemma4Args, sliding_layers
from models.gemma4.model import Gemma4Transformer
from models.gemma4.tensor_parallel import GEMMA4_TENSOR_PARALLEL


def _released(dim: int, n_layers: int, n_heads: int, n_kv_heads: int, ffn_dim: int, **fields) -> Gemma4Args:
    """A released text decoder: 262,144 tokens, heads of 256 (windowed) and 512 (global), a final
    softcap of 30, tied; E2B and E4B with per-layer inputs of 256 and windows of 512 over 128k
    positions, 26B-A4B and 31B with values as keys and windows of 1024 over 256k."""
    per_layer_dim = fields.pop("per_layer_dim", 0)
    small = per_layer_dim > 0
    return Gemma4Args(
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        ffn_dim=ffn_dim,
        max_seq_len=131072 if small else 262144,
        sliding_window=512 if small else 1024,
        window_layers=fields.pop("window_layers", sliding_layers(n_layers)),
        attention_k_eq_v=not small,
        per_layer_dim=per_layer_dim,
        final_logit_softcap=30.0,
        **fields,
    )


FLAVORS = {
    "debug": Gemma4Args(
        dim=128,
        n_layers=6,
        n_heads=4,
        n_kv_heads=2,
        head_dim=32,
        ffn_dim=256,
        vocab_size=512,
        max_seq_len=512,
        sliding_window=16,
        window_layers=[0, 1, 3, 4],  # layers 2 and 5 global: 5 reuses 2's keys, 4 reuses 3's
        global_head_dim=64,
        global_kv_heads=1,
        attention_k_eq_v=True,
        per_layer_dim=16,
        kv_shared_layers=2,
        final_logit_softcap=30.0,
    ),
    "E2B": _released(
        1536,
        35,
        8,
        1,
        6144,
        window_layers=sliding_layers(35, 5),
        per_layer_dim=256,
        kv_shared_layers=20,
        double_wide_mlp=True,
    ),
    "E4B": _released(2560, 42, 8, 2, 10240, per_layer_dim=256, kv_shared_layers=18),
    "26B-A4B": _released(2816, 30, 16, 8, 2112, global_kv_heads=2, n_experts=128, top_k=8, moe_ffn_dim=704),
    "31B": _released(5376, 60, 32, 16, 21504, global_kv_heads=4),
}


def attention_flops(args: Gemma4Args, layer: int, seq_len: int) -> int:
    """Training FLOPs per token of one layer's attention: q·k and weights·v over the positions a query
    sees (a windowed layer's window), in its kind's head size: 12·H·Q·K (the shared decoder's count)."""
    return 12 * args.n_heads * args.layer_head_dim(layer) * attended_keys(args, layer, seq_len)


def idle_parameters(args: Gemma4Args) -> int:
    """The parameters no matmul uses: the per-layer inputs' table (a lookup) and, per layer, the
    routed experts a token is not sent to."""
    table = args.per_layer_vocab * args.n_layers * args.per_layer_dim
    return table + args.n_layers * (args.n_experts - args.top_k) * 3 * args.dim * args.moe_ffn_dim * bool(
        args.n_experts
    )


def flops_per_token(args: Gemma4Args, seq_len: int, num_params: int | None = None) -> int:
    """6 FLOPs per parameter a token's matmuls use (counted on ``meta``, the tied matrix once) and
    each layer's attention."""
    if num_params is None:
        with torch.device("meta"):
            num_params = parameters(Gemma4Transformer(args))
    attention = sum(attention_flops(args, layer, seq_len) for layer in range(args.n_layers))
    return 6 * (num_params - idle_parameters(args)) + attention


def layer_flops(args: Gemma4Args, seq_len: int) -> LayerCosts:
    """The decoder's per-part count (``decoder_layer_flops``), the projection to the per-layer
    inputs (and its norm) counted with the first block, which the first stage runs with it (their
    table is a lookup)."""
    costs = decoder_layer_flops(args, seq_len, model=Gemma4Transformer, attention=attention_flops)
    projection = 6 * (args.dim * args.n_layers + 1) * args.per_layer_dim  # and its norm
    return dataclasses.replace(costs, blocks=(costs.blocks[0] + projection, *costs.blocks[1:]))


def joined_layers(args: Gemma4Args) -> list[tuple[int, int, str]]:
    """The layers a pipeline stage holds whole: the kv-shared layers with the layers whose keys and
    values they reuse (see the module docstring)."""
    if not args.kv_shared_layers:
        return []
    first = min(args.kv_source(i) for i in range(args.first_kv_shared_layer, args.n_layers))
    return [(first, args.n_layers - 1, "the last layers reuse the keys and values of the layers before them")]


GEMMA4 = dataclasses.replace(
    decoder_family(
        "gemma4",
        Gemma4Args,
        FLAVORS,
        (hf.MODEL_TYPE, hf.WRAPPER_TYPE),
        hf.config,
        hf.args_from_config,
        shape_fields=SHAPE_FIELDS,
        names=hf.Gemma4Names,
        osft_targets=(*OSFT_TARGETS, "per_layer.gate", "per_layer.projection"),
        flops_per_token=flops_per_token,
        layer_flops=layer_flops,
        tensor_parallel=GEMMA4_TENSOR_PARALLEL,
    ),
    model=Gemma4Transformer,
    first_stage=("tok_embeddings", "per_layer_inputs"),
    # a grown vocabulary grows the per-layer inputs' table with the embedding (as transformers resizes it)
    vocab_fqns=("tok_embeddings.weight", "output.weight", "per_layer_inputs.embeddings.weight"),
    joined_layers=joined_layers,
)
