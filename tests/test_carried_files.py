"""What a conversion carries beside the tensors: the tokenizer files and ``generation_config.json``.

An HF download converted to DCP and back must still ``generate()`` and stop where its author said;
a seed, which has neither, gets neither.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from seedckpt.cli import convert as convert_module
from seedckpt.cli.convert import convert
from seedckpt.data.tokenizer import TOKENIZER_FILES
from seedckpt.utils.errors import SeedckptError
from tests.tiny_tokenizers import build_tiny_tokenizer, corpus_of, make_chats

transformers = pytest.importorskip("transformers")

# The generation config as its author wrote it, less its eos ids (<|end_of_text|>, which the
# tokenizer does not call eos, and the tokenizer's): it sets no bos, which the tokenizer's fills on export.
AUTHORED = {"do_sample": False, "top_k": 7, "transformers_version": "5.0.0"}


def _always_predicts(model, token: int) -> None:
    """Make ``token`` the argmax at every position: dimension 0 of the residual stream holds a
    constant 10 (the embedding writes it, no layer writes there) and only ``token``'s output row
    reads it."""
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 10.0
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[0] = 0.0
            layer.mlp.down_proj.weight[0] = 0.0
        model.lm_head.weight[token] = 0.0
        model.lm_head.weight[token, 0] = 100.0


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    """A Llama directory as a download has it: weights, a tokenizer with a chat template and an
    authored generation config."""
    path = tmp_path_factory.mktemp("hf") / "model"
    build_tiny_tokenizer(path, corpus_of(make_chats(20)))
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    _always_predicts(model, _end_of_text(tokenizer))
    model.save_pretrained(path)
    authored = {**AUTHORED, "eos_token_id": [_end_of_text(tokenizer), tokenizer.eos_token_id]}
    (path / "generation_config.json").write_text(json.dumps(authored))
    return path


def _end_of_text(tokenizer) -> int:
    return tokenizer.convert_tokens_to_ids("<|end_of_text|>")


def test_hf_to_dcp_to_hf_keeps_the_tokenizer_and_generation_config(hf_dir, tmp_path):
    convert(hf_dir, tmp_path / "dcp", "dcp", progress=False)
    carried = sorted(p.name for p in (tmp_path / "dcp" / "tokenizer").iterdir())
    assert carried == sorted(name for name in TOKENIZER_FILES if (hf_dir / name).is_file())
    authored = (hf_dir / "generation_config.json").read_bytes()
    assert (tmp_path / "dcp" / "generation_config.json").read_bytes() == authored  # kept as it was

    convert(tmp_path / "dcp", tmp_path / "hf", "hf", progress=False)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    original = transformers.AutoTokenizer.from_pretrained(hf_dir)
    assert tokenizer.chat_template == original.chat_template
    assert tokenizer("What is 2 + 3?").input_ids == original("What is 2 + 3?").input_ids
    # The author's values win (both eos ids, top_k); the tokenizer's bos fills the key it lacked.
    written = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    assert written == {**json.loads(authored), "bos_token_id": tokenizer.bos_token_id}
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["eos_token_id"] == [tokenizer.eos_token_id]

    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    chat = [{"role": "user", "content": "What is 2 + 3?"}]
    text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    prompt = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
    with torch.no_grad():
        stopped = model.generate(prompt, max_new_tokens=8)
        # The tokenizer's eos alone would not stop it: the carried generation config does.
        unstopped = model.generate(prompt, max_new_tokens=8, eos_token_id=tokenizer.eos_token_id)
    assert stopped.shape[1] == prompt.shape[1] + 1 and stopped[0, -1].item() == _end_of_text(tokenizer)
    assert unstopped.shape[1] == prompt.shape[1] + 8


def test_a_seed_carries_no_tokenizer(debug_seed, tmp_path):
    convert(debug_seed, tmp_path / "hf", "hf", progress=False)
    convert(debug_seed, tmp_path / "dcp", "dcp", progress=False)
    written = {p.name for p in (tmp_path / "hf").iterdir()} | {p.name for p in (tmp_path / "dcp").iterdir()}
    assert not written & {*TOKENIZER_FILES, "generation_config.json", "tokenizer"}


def test_a_converted_checkpoint_with_its_tokenizer_is_replaced_with_force(hf_dir, tmp_path):
    convert(hf_dir, tmp_path / "dcp", "dcp", progress=False)
    convert(hf_dir, tmp_path / "dcp", "dcp", progress=False, force=True)
    assert (tmp_path / "dcp" / "tokenizer" / "tokenizer.json").is_file()


def test_a_single_file_target_says_what_it_leaves_behind(hf_dir, tmp_path):
    with pytest.warns(UserWarning, match=r"--to safetensors writes one file.*tokenizer\.json.*not carried"):
        convert(hf_dir, tmp_path / "model.safetensors", "safetensors", progress=False)


def _copy(hf_dir: Path, dst: Path) -> Path:
    dst.mkdir()
    for file in hf_dir.iterdir():
        (dst / file.name).write_bytes(file.read_bytes())
    return dst


def test_links_out_of_the_directory_are_left_behind_with_a_warning(hf_dir, tmp_path):
    src = _copy(hf_dir, tmp_path / "src")
    secret = tmp_path / "secret.txt"
    secret.write_text("not a tokenizer")
    (src / "tokenizer_config.json").unlink()
    os.symlink(secret, src / "tokenizer_config.json")
    with pytest.warns(UserWarning, match="tokenizer_config.json not carried: links out of the directory"):
        convert(src, tmp_path / "dcp", "dcp", progress=False)
    assert not (tmp_path / "dcp" / "tokenizer" / "tokenizer_config.json").exists()
    assert (tmp_path / "dcp" / "tokenizer" / "tokenizer.json").is_file()


def test_a_hugging_face_cache_snapshot_keeps_its_tokenizer(hf_dir, tmp_path):
    """A cache snapshot (``models--X/snapshots/REV/``) holds links into ``models--X/blobs/``: followed."""
    repo = tmp_path / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    for k, file in enumerate(sorted(hf_dir.iterdir())):
        blob = repo / "blobs" / f"{k:040x}"
        blob.write_bytes(file.read_bytes())
        os.symlink(os.path.relpath(blob, snapshot), snapshot / file.name)
    convert(snapshot, tmp_path / "dcp", "dcp", progress=False)
    carried = tmp_path / "dcp" / "tokenizer" / "tokenizer_config.json"
    assert carried.read_bytes() == (hf_dir / "tokenizer_config.json").read_bytes() and not carried.is_symlink()


@pytest.mark.parametrize(
    "damage, message",
    [
        ("oversized", r"tokenizer\.json is [\d,]+ bytes, more than the 1,000 a tokenizer file"),
        ("list", r"generation_config\.json holds a JSON list, not an object"),
    ],
)
def test_a_bad_carried_file_is_refused_before_writing(hf_dir, tmp_path, monkeypatch, damage, message):
    src = _copy(hf_dir, tmp_path / "src")
    if damage == "oversized":
        monkeypatch.setattr(convert_module, "MAX_CARRIED_BYTES", 1000)
    else:
        (src / "generation_config.json").write_text("[1, 2]")
    with pytest.raises(SeedckptError, match=message):
        convert(src, tmp_path / "dcp", "dcp", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]
