"""Which tokenizer a fine-tune uses: the one the pretrained directory carries (an HF download's, or a
seedckpt checkpoint's ``tokenizer/``) unless ``data.tokenizer`` names one that keeps its ids; one
that moves them is refused in one line naming both, and chat data with no tokenizer anywhere too.
Checked on a tiny Qwen3-MoE directory through ``load_config`` + ``resolve``, and one real step."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from seedckpt.cli.convert import convert
from seedckpt.config.job_config import load_config
from seedckpt.config.resolve import resolve
from seedckpt.data.tokenizer import load_tokenizer, moved_tokens
from seedckpt.utils.errors import SeedckptError
from tests.dist import run_main
from tests.test_moe_interop import _hf_moe
from tests.tiny_tokenizers import build_tiny_tokenizer, corpus_of, make_chats

transformers = pytest.importorskip("transformers")
REPO = Path(__file__).resolve().parents[1]
MOE_CONFIG = "configs/sft_qwen3_moe_debug.toml"
DEMO_TOKENIZER = REPO / "configs" / "sft_demo" / "tokenizer"
VOCAB = 416  # the model's own tokenizer's size; the demo tokenizer has 600 other tokens


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """A random two-layer Qwen3-MoE (four experts) three ways: an HF directory with its own tokenizer
    (BPE of other chats than the demo's), that directory converted to DCP (the tokenizer in
    ``tokenizer/``), and one without any."""
    root = tmp_path_factory.mktemp("moe")
    bare = _hf_moe("qwen3_moe", root / "bare", vocab=VOCAB)
    hf = shutil.copytree(bare, root / "hf")
    build_tiny_tokenizer(hf, corpus_of(make_chats(64, seed=1)), vocab_size=VOCAB)
    assert len(load_tokenizer(hf)) == VOCAB
    convert(hf, root / "dcp", to="dcp")
    return {"hf": hf, "dcp": root / "dcp", "bare": bare}


class _Vocab:
    """Just what ``moved_tokens`` asks of a tokenizer."""

    def __init__(self, vocab: dict[str, int], added: tuple[str, ...] = ()):
        self.vocab, self.added = vocab, {token: vocab[token] for token in added}

    def get_vocab(self) -> dict[str, int]:
        return self.vocab

    def get_added_vocab(self) -> dict[str, int]:
        return self.added


@pytest.mark.parametrize(
    "vocab, moved",
    [
        ({"<s>": 0, "a": 1, "b": 2, "<tool>": 3}, []),  # tokens added after the model's
        ({"<tool>": 0, "a": 1, "b": 2}, []),  # a special token renamed
        ({"<s>": 3, "a": 1, "b": 2, "<tool>": 0}, [("<s>", 0, 3)]),  # ... but not moved
        ({"<s>": 0, "a": 1}, [("b", 2, None)]),  # a regular token missing
        ({"<s>": 0, "b": 1, "a": 2}, [("a", 1, 2), ("b", 2, 1)]),  # another BPE: in id order
    ],
)
def test_a_tokenizer_keeps_the_models_ids_when_it_only_adds_or_renames_special_tokens(vocab, moved):
    base = _Vocab({"<s>": 0, "a": 1, "b": 2}, added=("<s>",))
    assert moved_tokens(_Vocab(vocab), base) == moved


@pytest.fixture(autouse=True)
def in_repo(monkeypatch):
    """The shipped configs name their data relative to the repository."""
    monkeypatch.chdir(REPO)


def _resolved(config: str, pretrained: Path, *overrides: str):
    """The run ``config`` describes on two ranks (both shipped configs' layouts), fine-tuning ``pretrained``."""
    cfg = load_config(REPO / config, ["--finetune.pretrained", str(pretrained), *overrides])
    return resolve(cfg, 2, local_world_size=0)


@pytest.mark.parametrize("source, own", [("hf", "."), ("dcp", "tokenizer")])
def test_the_directorys_own_tokenizer_is_the_default(models, source, own):
    """The MoE config names no tokenizer: the HF directory's (or the converted checkpoint's
    ``tokenizer/``) is used, the vocabulary stays the model's, and the log line says which."""
    run = _resolved(MOE_CONFIG, models[source])
    tokenizer = models[source] / own
    assert Path(run.cfg.data.tokenizer) == tokenizer
    assert run.args.vocab_size == VOCAB and run.dims.ep == 2
    assert f"tokenizer: finetune.pretrained's own, {tokenizer} ({VOCAB} tokens)" in run.notes, run.notes


def test_a_configs_tokenizer_that_is_not_the_models_is_refused_in_one_line(models):
    """The demo config's 600-token tokenizer against a model with its own 416 (the issue: it grew
    the vocabulary with one log line): refused, naming both and the fix, which then resolves."""
    hf = models["hf"]
    with pytest.raises(SeedckptError) as refused:
        _resolved("configs/sft_debug.toml", hf)
    message = str(refused.value)
    assert "\n" not in message
    assert "data.tokenizer configs/sft_demo/tokenizer (600 tokens) is not" in message
    assert f"finetune.pretrained's own tokenizer, {hf} ({VOCAB} tokens)" in message
    assert f"set --data.tokenizer {hf} (the model's own)" in message
    assert _resolved("configs/sft_debug.toml", hf, "--data.tokenizer", str(hf)).args.vocab_size == VOCAB


def test_a_tokenizer_that_adds_tokens_after_the_models_grows_the_vocabulary(models, tmp_path):
    extended = load_tokenizer(models["hf"])
    extended.add_tokens(["<tool_call>", "</tool_call>", "<think>", "</think>", "<image>"])
    extended.save_pretrained(tmp_path / "extended")
    run = _resolved(MOE_CONFIG, models["hf"], "--data.tokenizer", str(tmp_path / "extended"))
    assert run.args.vocab_size == 424  # 421 tokens, to the next multiple of 8
    assert any(f"which keeps every id of finetune.pretrained's own {models['hf']}" in n for n in run.notes), run.notes


def test_a_directory_without_a_tokenizer_takes_data_tokenizer_and_says_it_is_unchecked(models):
    run = _resolved(MOE_CONFIG, models["bare"], "--data.tokenizer", str(DEMO_TOKENIZER))
    assert run.args.vocab_size == 600
    assert any("carries no tokenizer, so nothing checks" in note for note in run.notes), run.notes


def test_chat_data_without_any_tokenizer_is_refused_with_the_fix(models):
    with pytest.raises(SeedckptError) as refused:
        load_config(REPO / MOE_CONFIG, ["--finetune.pretrained", str(models["bare"])])
    message = str(refused.value)
    assert "\n" not in message
    assert f"finetune.pretrained {models['bare']} carries none" in message and "set --data.tokenizer" in message


def test_one_step_of_the_shipped_moe_config_saves_the_models_own_tokenizer(models, tmp_path):
    """A real run (one process, one step): the trainer reads the chats with the directory's
    tokenizer and saves that tokenizer with its step."""
    argv = ["--config", MOE_CONFIG, "--finetune.pretrained", str(models["hf"])]
    argv += ["--parallelism.expert_parallel_degree", "1", "--training.steps", "1", "--training.warmup_steps", "1"]
    argv += ["--training.seq_len", "64", "--checkpoint.interval", "1"]
    argv += ["--checkpoint.folder", str(tmp_path / "ckpt"), "--job.dump_folder", str(tmp_path / "run")]
    proc = run_main(argv, 1, {**os.environ, "OMP_NUM_THREADS": "1"}, REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"tokenizer: finetune.pretrained's own, {models['hf']} ({VOCAB} tokens)" in proc.stdout
    saved = tmp_path / "ckpt" / "step-1" / "tokenizer" / "tokenizer.json"
    assert saved.read_bytes() == (models["hf"] / "tokenizer.json").read_bytes()
