"""Llama 3 / 3.1 / 3.2: the family's hooks, everything generic code asks about a Llama.

Tensor names are Meta's and torchtitan <= 0.2's (checkpoints and outside tools rely on them):
``tok_embeddings.weight``, ``layers.{i}.attention.{wq,wk,wv,wo}.weight``,
``layers.{i}.feed_forward.{w1,w2,w3}.weight``, ``layers.{i}.{attention_norm,ffn_norm}.weight``,
``norm.weight``, ``output.weight``. Hugging Face's are ``LlamaForCausalLM``'s (``hf``), torchtitan
0.3's are mapped by ``torchtitan``.
"""

from models.family import HFAdapter, ModelFamily, decoder_flops_per_token
from models.llama3 import hf
from models.llama3.args import LLAMA3_FLAVORS, SHAPE_FIELDS, ModelArgs, tied_weights
from models.llama3.model import Transformer
from models.llama3.torchtitan import TorchtitanNames

LLAMA3 = ModelFamily(
    name="llama3", args=ModelArgs, model=Transformer, flavors=LLAMA3_FLAVORS, shape_fields=SHAPE_FIELDS,
    tied_weights=tied_weights, first_stage=("tok_embeddings",), last_stage=("norm", "output"),
    vocab_fqns=("tok_embeddings.weight", "output.weight"),
    osft_targets=("attention.wq", "attention.wk", "attention.wv", "attention.wo",
                  "feed_forward.w1", "feed_forward.w2", "feed_forward.w3"),
    flops_per_token=lambda args, seq_len: decoder_flops_per_token(Transformer, args, seq_len),
    hf=HFAdapter(model_types=("llama",), names=hf.HFNames, config=hf.hf_config,
                 args_from_config=hf.args_from_hf_config),
    renamings={"torchtitan": TorchtitanNames()},
)
