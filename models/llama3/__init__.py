"""Llama 3 / 3.1 / 3.2: the shared decoder's plain case (``models.common.decoder``), with
torchtitan's init recipe.

Tensor names are Meta's and torchtitan <= 0.2's (checkpoints and outside tools rely on them):
``tok_embeddings.weight``, ``layers.{i}.attention.{wq,wk,wv,wo}.weight``,
``layers.{i}.feed_forward.{w1,w2,w3}.weight``, ``layers.{i}.{attention_norm,ffn_norm}.weight``,
``norm.weight``, ``output.weight``. Hugging Face's are ``LlamaForCausalLM``'s (``hf``), torchtitan
0.3's are mapped by ``torchtitan``.
"""

from models.common import decoder_family
from models.llama3 import hf
from models.llama3.args import LLAMA3_FLAVORS, SHAPE_FIELDS, ModelArgs
from models.llama3.torchtitan import TorchtitanNames

LLAMA3 = decoder_family(
    "llama3",
    ModelArgs,
    LLAMA3_FLAVORS,
    ("llama",),
    hf.hf_config,
    hf.args_from_hf_config,
    shape_fields=SHAPE_FIELDS,
    renamings={"torchtitan": lambda args: TorchtitanNames()},
)
