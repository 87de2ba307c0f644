"""A fine-tune's ``[model]`` keys (issue 46 item 9): those of the pretrained checkpoint's family, found
without ``model.name``; one that keeps the checkpoint's tensors applies to its args (the run log names
it with the checkpoint's value), one that would change them is refused in one line, and an unknown
key lists that family's keys. A tiny Qwen3-MoE HF directory and its DCP conversion."""

from __future__ import annotations

from pathlib import Path

import pytest

from seedckpt.cli.convert import convert
from seedckpt.config.job_config import load_config
from seedckpt.config.resolve import resolve
from seedckpt.materialize.model_checkpoint import check_args_match
from seedckpt.utils.errors import SeedckptError
from tests.test_moe_interop import DIM, _hf_moe

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe")
    hf = _hf_moe("qwen3_moe", root / "hf")
    return {"hf": hf, "dcp": convert(hf, root / "dcp", to="dcp", progress=False)}


def _resolved(pretrained: Path, *keys: str):
    cfg = load_config(None, ["--finetune.mode", "sft", "--finetune.pretrained", str(pretrained), *keys])
    return resolve(cfg, 1, local_world_size=0)


@pytest.mark.parametrize("source", ["hf", "dcp"])
@pytest.mark.parametrize("name", [[], ["--model.name", "qwen3_moe"]], ids=["family found", "family named"])
def test_keys_that_keep_the_tensors_apply_to_the_pretrained_args(sources, source, name):
    run = _resolved(
        sources[source], *name, "--model.load_balance", "none", "--model.aux_loss_coef", "0.01", "--model.top_k", "3"
    )
    assert run.family.name == run.cfg.model.name == "qwen3_moe"
    assert (run.args.load_balance, run.args.aux_loss_coef, run.args.top_k) == ("none", 0.01, 3)
    [line] = [note for note in run.notes if note.startswith("[model] keys applied")]
    assert "load_balance = 'none' ('aux_loss'); aux_loss_coef = 0.01 (0.001); top_k = 3 (2)" in line, line
    check_args_match(run.pretrained, run.args)  # what each rank checks before loading: the same tensors


@pytest.mark.parametrize(
    "keys,named",
    [
        (["--model.dim", "8"], f"model.dim = 8 (the checkpoint: {DIM})"),
        (["--model.n_experts", "8", "--model.dim", str(DIM)], "model.n_experts = 8 (the checkpoint: 4)"),
        (["--model.load_balance", "bias"], "model.load_balance = 'bias' (the checkpoint: 'aux_loss')"),
        # the same shapes, but the trained output projection would be replaced by the embedding
        (["--model.tie_word_embeddings", "true"], "model.tie_word_embeddings = True (the checkpoint: False)"),
    ],
    ids=["dim", "experts", "a bias tensor", "a tie"],
)
def test_keys_that_change_the_tensors_are_refused_in_one_line(sources, keys, named):
    with pytest.raises(SeedckptError) as refused:
        _resolved(sources["hf"], *keys)
    message = str(refused.value)
    assert message.startswith(f"[model] would change the tensors of finetune.pretrained {sources['hf']}, which fixes")
    assert named in message and "aux_loss_coef" in message.split("keep its tensors apply:")[1], message
    assert "\n" not in message


def test_an_unknown_key_lists_the_pretrained_familys_keys(sources):
    with pytest.raises(SeedckptError, match=r"did you mean 'load_balance'\?") as refused:
        _resolved(sources["hf"], "--model.load_balanse", "none")
    assert f"for qwen3_moe, the family of finetune.pretrained {sources['hf']}" in str(refused.value)
    with pytest.raises(SeedckptError) as refused:
        _resolved(sources["hf"], "--model.zzz", "1")
    listed = str(refused.value).split("valid: ")[1].split(", ")
    assert "moe_ffn_dim" in listed and "multiple_of" not in listed  # Qwen3-MoE's fields, not Llama's
