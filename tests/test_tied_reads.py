"""A model that ties its output to the embedding, reading a checkpoint that stores the output apart
(``OpenedCheckpoint.refuse_distinct_tied``): a copy of the embedding is the tie; other values are
refused in one line naming ``model.tie_word_embeddings = false`` -- by the seed check of a run or a
``load_model``, and by the reader of a DCP checkpoint in our names or torchtitan's -- where one of
the two matrices used to be dropped without a word. Llama 3 and Qwen3.5-MoE (torchtitan's names)."""

from __future__ import annotations

import warnings

import pytest
import torch.distributed.checkpoint as dcp

from models.llama3.torchtitan import to_torchtitan_name
from seedckpt import load_model
from seedckpt.checkpoint.manifest import MANIFEST_NAME
from seedckpt.cli.convert import convert, diff
from seedckpt.materialize.seed import create_seed_checkpoint
from seedckpt.materialize.stages import build_stages
from seedckpt.parallel.pipeline import plan_rank_stages
from seedckpt.utils.errors import SeedckptError
from tests.conftest import stock_load, tiny_config

TIED = ("--model.tie_word_embeddings", "true")
REFUSAL = r"stores {} apart from tok_embeddings.weight, with other values, .* set model.tie_word_embeddings = false"


def _read_tied(path, *model: str):
    """``path`` read as each command reads it into the tied model of ``model``: a run's stages, and
    convert (which reads every tensor)."""
    args = tiny_config(*model, *TIED).model_args()
    build_stages(args, plan_rank_stages(args, 0, 1), "cpu", checkpoint=path)
    convert(path, path.parent / f"{path.name}-converted", "dcp", progress=False, args=args)


def test_a_seed_trained_untied_is_refused_by_a_tied_run(debug_seed):
    """The seed records an untied model; a tied config agrees on every shape, so only the values say
    the output is not the embedding."""
    with pytest.raises(SeedckptError, match=REFUSAL.format("output.weight")):
        _read_tied(debug_seed)


@pytest.mark.parametrize("names", ["ours", "torchtitan"])
def test_a_dcp_checkpoint_stored_untied_is_refused_by_a_tied_model(tmp_path, debug_seed, names):
    """A DCP checkpoint without our manifest (stock ``dcp.save``, as torchtitan's checkpointer writes)
    holding a distinct output, read by load_model, a run and convert with a tied config."""
    rename = to_torchtitan_name if names == "torchtitan" else str
    dcp.save({rename(k): v for k, v in stock_load(debug_seed).items()}, checkpoint_id=str(tmp_path / "c"), no_dist=True)
    head = "lm_head.weight" if names == "torchtitan" else "output.weight"
    with pytest.raises(SeedckptError, match=REFUSAL.format(head)):
        load_model(tmp_path / "c", args=tiny_config(*TIED).model_args())
    with pytest.raises(SeedckptError, match=REFUSAL.format(head)):
        _read_tied(tmp_path / "c")


def test_a_copy_of_the_embedding_is_read_as_the_tie(tmp_path, tied_seed):
    """torchtitan ties none: a tied seed's export holds the embedding twice, and reads back into the
    tied model as the seed, without a word."""
    titan = convert(tied_seed, tmp_path / "titan", "torchtitan", progress=False)
    (titan / MANIFEST_NAME).unlink()  # as torchtitan's own checkpoint: the config is the caller's
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _read_tied(titan)
    equal, lines = diff(tied_seed, titan.parent / "titan-converted")
    assert equal, lines


def test_a_moe_stored_untied_in_torchtitans_names_is_refused_by_a_tied_model(tmp_path):
    """Qwen3.5-MoE's torchtitan names (its ``lm_head``), read with and without the manifest that
    records the untied model."""
    model = ("--model.name", "qwen3_5_moe")
    seed = create_seed_checkpoint(tiny_config(*model), tmp_path / "seed", seed=0, progress=False, workers=1)
    titan = convert(seed, tmp_path / "titan", "torchtitan", progress=False)
    with pytest.raises(SeedckptError, match=REFUSAL.format("lm_head.weight")):
        _read_tied(titan, *model)
    (titan / MANIFEST_NAME).unlink()
    with pytest.raises(SeedckptError, match=REFUSAL.format("lm_head.weight")):
        _read_tied(titan, *model)


def test_an_hf_head_distinct_past_its_first_mib_is_read_untied_as_transformers_does(tmp_path):
    """config.json ties, the files also hold an ``lm_head`` equal to the embedding but in its last
    row (past the first MiB, where a sample stopped): transformers compares every value and unties;
    so does the reader, in one line, with transformers' logits."""
    import torch
    import transformers
    from safetensors.torch import load_file, save_file

    seed = create_seed_checkpoint(
        tiny_config(*TIED, "--model.vocab_size", "4096"), tmp_path / "seed", seed=0, progress=False
    )
    hf = convert(seed, tmp_path / "hf", "hf", progress=False)
    [file] = hf.glob("*.safetensors")
    tensors = load_file(file)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    tensors["lm_head.weight"][-1] += 0.5  # 2 MiB in float32: its last row lies past the first MiB
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.warns(UserWarning, match="store a distinct lm_head.weight: loaded untied, as transformers does"):
        ours = load_model(hf)
    reference = transformers.AutoModelForCausalLM.from_pretrained(hf).eval()
    tokens = torch.tensor([[4095, 1, 4095, 7]])
    with torch.no_grad():
        assert (ours(tokens) - reference(tokens).logits).abs().max().item() <= 1e-5


def test_an_hf_head_stored_quantized_is_compared_by_its_values(tmp_path):
    """config.json ties, the files hold an FP8-block ``lm_head`` (its bytes are not its values): an
    embedding holding the values it stands for is the tie, read without a word; one row off, the head
    is distinct and read untied. Its bytes used to be compared with the embedding's as if plain."""
    from safetensors.torch import load_file, save_file

    from seedckpt.materialize.model_checkpoint import open_model_checkpoint
    from tests.quantizers import quantize_directory

    seed = create_seed_checkpoint(tiny_config(*TIED, "--model.vocab_size", "256"), tmp_path / "seed", 0, progress=False)
    hf = convert(seed, tmp_path / "hf", "hf", progress=False)
    [file] = hf.glob("*.safetensors")
    tensors = load_file(file)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, file, metadata={"format": "pt"})
    quantize_directory(hf, tmp_path / "q", "fp8", lambda name, _: name == "lm_head.weight", tmp_path / "values")
    [file] = (tmp_path / "q").glob("*.safetensors")
    head = load_file(tmp_path / "values" / file.name)["lm_head.weight"]
    for row_off, tied in ((0.0, True), (0.5, False)):
        embedding = head.clone()
        embedding[-1] += row_off
        save_file({**load_file(file), "model.embed_tokens.weight": embedding}, file, metadata={"format": "pt"})
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            assert open_model_checkpoint(tmp_path / "q").args.tie_word_embeddings is tied
        assert any("distinct lm_head.weight: loaded untied" in str(w.message) for w in said) is not tied
