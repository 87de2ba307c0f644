"""Tiny Hugging Face tokenizers and chat sets built offline, for tests and the shipped demo data.

``python -m tests.tiny_tokenizers configs/sft_demo`` regenerates ``configs/sft_demo/{chats.jsonl,tokenizer/}``.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]


def chat_template(drop_past_thinking: bool = False, generation_markers: bool = False) -> str:
    """Llama-3's chat format, without its default system message. ``drop_past_thinking``: like
    Qwen3's, an assistant turn before the last user message loses its ``<think>...</think>`` block
    (so a conversation's beginning renders differently from the whole). ``generation_markers``: the
    assistant's content and end of turn inside ``{% generation %}`` ... ``{% endgeneration %}``."""
    content = "{{ m['content'] }}"
    head = ""
    if drop_past_thinking:
        head = (
            "{% set ns = namespace(last_user=-1) %}{% for m in messages %}"
            "{% if m['role'] == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}"
        )
        content = (
            "{% if m['role'] == 'assistant' and loop.index0 < ns.last_user and '</think>' in m['content'] %}"
            "{{ m['content'].split('</think>')[-1].lstrip('\\n') }}{% else %}{{ m['content'] }}{% endif %}"
        )
    turn = content + "<|eot_id|>"
    if generation_markers:
        marked = f"{{% generation %}}{turn}{{% endgeneration %}}"
        turn = f"{{% if m['role'] == 'assistant' %}}{marked}{{% else %}}{turn}{{% endif %}}"
    return (
        head + "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
        f"{turn}{{% endfor %}}"
        "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
    )


CHAT_TEMPLATE = chat_template()

CAPITALS = {
    "France": "Paris",
    "Japan": "Tokyo",
    "Italy": "Rome",
    "Spain": "Madrid",
    "Egypt": "Cairo",
    "Canada": "Ottawa",
    "Kenya": "Nairobi",
    "Peru": "Lima",
    "Norway": "Oslo",
    "Chile": "Santiago",
    "Poland": "Warsaw",
    "Greece": "Athens",
    "Cuba": "Havana",
    "Nepal": "Kathmandu",
    "Ghana": "Accra",
}
SYSTEMS = ["You are a helpful assistant.", "Answer briefly."]


def build_tiny_tokenizer(
    path: Path, corpus: list[str], vocab_size: int = 300, chat_template: str | None = CHAT_TEMPLATE
) -> Path:
    """A byte-level BPE trained on ``corpus``, saved with ``save_pretrained`` (no pad token: the eos
    fallback applies)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator(corpus, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(path)
    return Path(path)


def make_chats(n: int, seed: int = 0) -> list[dict]:
    """Small memorizable conversations: capitals and sums, some with a system message, some multi-turn."""
    rng = random.Random(seed)
    chats = []
    for _ in range(n):
        messages = [{"role": "system", "content": rng.choice(SYSTEMS)}] if rng.random() < 0.3 else []
        for _ in range(rng.choice((1, 1, 2))):
            if rng.random() < 0.5:
                country = rng.choice(sorted(CAPITALS))
                messages += [
                    {"role": "user", "content": f"What is the capital of {country}?"},
                    {"role": "assistant", "content": f"The capital of {country} is {CAPITALS[country]}."},
                ]
            else:
                a, b = rng.randint(1, 9), rng.randint(1, 9)
                messages += [
                    {"role": "user", "content": f"What is {a} + {b}?"},
                    {"role": "assistant", "content": f"{a} + {b} = {a + b}."},
                ]
        chats.append({"messages": messages})
    return chats


def corpus_of(chats: list[dict]) -> list[str]:
    return [m["content"] for c in chats for m in c["messages"]]


if __name__ == "__main__":  # the shipped demo set: 200 conversations, a tokenizer larger than the debug vocab
    from seedckpt.data.sources import builtin_corpus

    out = Path(sys.argv[1])
    demo = make_chats(200, seed=0)
    out.mkdir(parents=True, exist_ok=True)
    (out / "chats.jsonl").write_text("".join(json.dumps(c) + "\n" for c in demo))
    english = builtin_corpus().decode(errors="replace").splitlines()  # enough text for 600 tokens
    build_tiny_tokenizer(out / "tokenizer", corpus_of(demo) * 5 + english, vocab_size=600)
