"""Conversion between DCP, Hugging Face safetensors, safetensors and torch.save; diff; stage loading
straight from an HF directory. Parity is checked against ``transformers`` itself."""

from __future__ import annotations

import json
import re
import weakref
from pathlib import Path

import pytest
import torch

import seedckpt.checkpoint.load as slabs
from models.common.hf_names import permute_from_hf, permute_to_hf
from seedckpt.checkpoint import OpenedCheckpoint, TensorInfo
from seedckpt.cli import convert as convert_module
from seedckpt.cli.convert import convert, diff
from seedckpt.cli.main import main
from seedckpt.config.job_config import load_config
from seedckpt.materialize.model_checkpoint import codec_for, open_model_checkpoint
from seedckpt.materialize.seed import create_seed_checkpoint
from seedckpt.materialize.stages import build_stages
from seedckpt.parallel.pipeline import plan_rank_stages
from seedckpt.utils import resources
from seedckpt.utils.errors import SeedckptError
from tests.conftest import check_tied_stock_load, probe_readings, stock_load, tiny_config

REPO = Path(__file__).resolve().parents[1]

transformers = pytest.importorskip("transformers")


def _hf_llama(tie: bool = False, seed: int = 0):
    """A small random LlamaForCausalLM (GQA, Llama-3.1 rope scaling), built offline from a config."""
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        max_position_embeddings=128,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
        tie_word_embeddings=tie,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # make every tensor random, norms included, so nothing can hide
        for p in model.parameters():
            p.normal_(0, 0.05) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    return model


def our_logits(checkpoint, tokens, pp: int = 1):

    args = open_model_checkpoint(checkpoint).args
    h = tokens
    for rank in range(pp):
        [stage] = build_stages(args, plan_rank_stages(args, rank, pp), "cpu", checkpoint=checkpoint)
        h = stage(h)
    return h


TOKENS = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(0))


def test_hf_to_dcp_to_our_model_matches_transformers(tmp_path):
    hf = _hf_llama()
    hf.save_pretrained(tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "dcp", "dcp", progress=False)
    with torch.no_grad():
        want = hf(TOKENS).logits
        got = our_logits(tmp_path / "dcp", TOKENS)
    assert (got - want).abs().max().item() <= 1e-5


def test_stage_loading_straight_from_hf_directory(tmp_path):
    hf = _hf_llama()
    hf.save_pretrained(tmp_path / "hf")
    with torch.no_grad():
        want = hf(TOKENS).logits
        for pp in (1, 3):  # each stage reads only its own tensors through DCP's HF reader
            assert (our_logits(tmp_path / "hf", TOKENS, pp) - want).abs().max().item() <= 1e-5


def test_our_model_to_hf_loads_in_transformers(tmp_path):
    toml = tmp_path / "job.toml"
    toml.write_text(
        '[model]\nflavor = "debug"\nrope_theta = 500000.0\n'
        "[model.rope_scaling]\nfactor = 8.0\noriginal_max_position_embeddings = 16\n"
    )
    cfg = load_config(toml)
    assert cfg.model_args().n_kv_heads < cfg.model_args().n_heads  # GQA
    seed = create_seed_checkpoint(cfg, tmp_path / "seed", seed=3, progress=False)
    convert(seed, tmp_path / "hf", "hf", max_shard_size="1MB", progress=False)
    files = sorted(p.name for p in (tmp_path / "hf").glob("*.safetensors"))
    assert len(files) > 1 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(files)
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    tokens = TOKENS % cfg.model_args().vocab_size
    with torch.no_grad():
        assert (hf(tokens).logits - our_logits(seed, tokens)).abs().max().item() <= 1e-5


def test_tied_embeddings_are_stored_once_and_read_as_the_output(tmp_path):
    hf = _hf_llama(tie=True)
    hf.save_pretrained(tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "dcp", "dcp", progress=False)
    check_tied_stock_load(tmp_path / "dcp")
    with torch.no_grad():
        assert (our_logits(tmp_path / "dcp", TOKENS) - hf(TOKENS).logits).abs().max().item() <= 1e-5


@pytest.mark.parametrize(
    "to,dst", [("dcp", "dcp"), ("hf", "hf"), ("torch", "m.pt"), ("safetensors", "m.safetensors"), ("torchtitan", "tt")]
)
def test_a_tied_checkpoint_converts_as_each_format_stores_ties_and_diffs_equal(tmp_path, tied_seed, to, dst):
    """DCP and HF store the tied matrix once (HF: no ``lm_head.weight``, ``tie_word_embeddings``),
    the others under both names; every export holds the seed's values."""
    out = convert(tied_seed, tmp_path / dst, to, progress=False)
    equal, lines = diff(tied_seed, out)
    assert equal, lines
    if to == "dcp":
        check_tied_stock_load(out)
    elif to == "hf":
        assert json.loads((out / "config.json").read_text())["tie_word_embeddings"]
        assert "lm_head.weight" not in json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    elif to == "torch":
        state = torch.load(out, weights_only=True)
        assert torch.equal(state["output.weight"], state["tok_embeddings.weight"])


def test_permutation_is_per_kv_head_and_invertible():
    w = torch.arange(8 * 6, dtype=torch.float32).view(8, 6)  # 2 heads of head_dim 4
    hf = permute_to_hf(w, 2)
    # Head 0 rows (pairs (0,1), (2,3)) become halves: even rows first, then odd rows.
    assert hf[:4, 0].tolist() == [0, 12, 6, 18]
    assert torch.equal(permute_from_hf(hf, 2), w)
    assert not torch.equal(permute_from_hf(hf, 1), w)  # the head count matters (GQA)


@pytest.mark.parametrize("via,dst", [("hf", "hf"), ("torch", "m.pt"), ("safetensors", "m.safetensors")])
def test_round_trips_are_bitwise_and_diff_agrees(tmp_path, debug_seed, via, dst):
    convert(debug_seed, tmp_path / dst, via, progress=False)
    convert(tmp_path / dst, tmp_path / "back", "dcp", progress=False)
    equal, lines = diff(debug_seed, tmp_path / "back")
    assert equal, lines
    equal, lines = diff(debug_seed, tmp_path / dst)  # across formats too
    assert equal, lines


def _planted(src: Path, tmp_path: Path, fqn: str, delta: float, dtype: str | None = None) -> Path:
    """``src`` as a torch.save file (cast to ``dtype``) with ``delta`` added to one element of ``fqn``."""
    convert(src, tmp_path / "m.pt", "torch", dtype=dtype, progress=False)
    state = torch.load(tmp_path / "m.pt", weights_only=True)
    state[fqn][1, 2] += delta
    torch.save(state, tmp_path / "changed.pt")
    return tmp_path / "changed.pt"


def test_diff_reports_a_planted_change_by_fqn(tmp_path, debug_seed, capsys):
    _planted(debug_seed, tmp_path, "layers.4.feed_forward.w2.weight", 0.5)
    assert main(["diff", str(debug_seed), str(tmp_path / "changed.pt")]) == 1
    out = capsys.readouterr().out
    assert "layers.4.feed_forward.w2.weight: max |delta| 0.5" in out
    assert out.count("max |delta|") == 1 and "different" in out
    assert main(["diff", str(debug_seed), str(tmp_path / "changed.pt"), "--atol", "0.6"]) == 0


def test_bfloat16_export_equals_its_source_within_atol_only(tmp_path, debug_seed):
    """Exact comparison counts the dtype; with an atol the values are compared after casting, one
    summary line says so, and a change larger than atol is still named."""
    convert(debug_seed, tmp_path / "hf", "hf", dtype="bfloat16", progress=False)
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    equal, lines = diff(debug_seed, tmp_path / "hf")
    assert not equal and len(lines) == 58 and all(line.endswith(" (dtype float32 vs bfloat16)") for line in lines[:-1])
    rounding = max((t - t.bfloat16().double()).abs().max().item() for t in stock_load(debug_seed).values())
    assert 0 < rounding < 0.02  # half a bf16 ulp is at most 2**-6 below 8 (the embedding's N(0, 1) values)
    equal, lines = diff(debug_seed, tmp_path / "hf", atol=0.02)
    casting = "57 tensors differ in dtype (float32 vs bfloat16): compared after casting to float32"
    assert equal and lines == [casting, "equal: 57 tensors compared (dcp vs hf, atol 0.02)"], lines
    changed = _planted(debug_seed, tmp_path, "layers.2.feed_forward.w1.weight", 0.5, dtype="bfloat16")
    equal, lines = diff(debug_seed, changed, atol=0.02)
    assert not equal and len(lines) == 3 and lines[1] == casting, lines
    assert lines[0].startswith("layers.2.feed_forward.w1.weight: max |delta| 0.5")


def _osft_checkpoint(seed: Path, dst: Path, patterns: tuple[str, ...] = ()) -> Path:
    """What an OSFT run's ``step-N`` holds (the targets as SVD factors, the OSFT settings in the
    manifest), made from ``seed`` by its SVDs alone: no training needed to compare it with exports."""
    from seedckpt.checkpoint import make_manifest, write_checkpoint
    from seedckpt.finetune.osft import FROZEN, TRAINABLE, OSFTSettings, decompose, osft_record

    source = open_model_checkpoint(seed)
    spec = OSFTSettings(0.25, patterns)
    state = {}
    for fqn in codec_for().layout(source.args, spec).shapes:
        base, _, name = fqn.rpartition(".")
        if name == "U_high":
            factors = decompose(source.read_tensor(f"{base}.weight"), spec.ratio)
            state.update({f"{base}.{n}": getattr(factors, n).contiguous() for n in FROZEN + TRAINABLE})
        elif name not in FROZEN + TRAINABLE:
            state[fqn] = source.read_tensor(fqn)
    finetune = {"mode": "osft", "pretrained": str(seed), **osft_record(spec)}
    return write_checkpoint(
        dst, state, make_manifest("train", "llama3", "debug", source.args.to_dict(), finetune=finetune)
    )


def _rebuilt(path: Path) -> str:
    """diff's report line for a side whose OSFT factors it compared as dense weights."""
    return f"{path}: OSFT factors compared as the dense weights they rebuild"


@pytest.mark.parametrize("to,dense", [("hf", False), ("dcp", True)])
def test_diff_compares_osft_factors_with_their_dense_export(tmp_path, debug_seed, to, dense):
    """The factor side is rebuilt dense, as ``convert`` exports it: bitwise equal, no "only in"
    lines, and a change to one target's weight in the export is named by its ``.weight`` FQN."""
    step = _osft_checkpoint(debug_seed, tmp_path / "step-1")
    convert(step, tmp_path / "export", to, dense=dense, progress=False)
    equal, lines = diff(step, tmp_path / "export")
    assert equal and lines == [_rebuilt(step), f"equal: 57 tensors compared (dcp vs {to}, atol 0)"], lines
    equal, lines = diff(_planted(tmp_path / "export", tmp_path, "layers.3.attention.wv.weight", 0.25), step)
    assert not equal and lines[0] == _rebuilt(step), lines
    assert lines[1].startswith("layers.3.attention.wv.weight: max |delta| 0.25") and len(lines) == 3, lines


def test_diff_compares_the_same_factors_as_stored_and_other_factors_dense(tmp_path, debug_seed):
    """Same OSFT settings: factor by factor, nothing rebuilt. Other targets: both sides rebuilt."""
    step = _osft_checkpoint(debug_seed, tmp_path / "step-1")
    equal, lines = diff(step, step)
    assert equal and lines == ["equal: 267 tensors compared (dcp vs dcp, atol 0)"], lines  # 42 targets x 6 + 15
    other = _osft_checkpoint(debug_seed, tmp_path / "other", (r"layers\.0\.attention\.wq",))
    equal, lines = diff(step, other, atol=1e-5)  # SVD round trip: within 1e-5 of the seed's weights
    assert equal and lines[:2] == [_rebuilt(step), _rebuilt(other)] and len(lines) == 3, lines


def _assert_nothing_written(tmp_path: Path, name: str):
    """No output and no partial of any writer (``.NAME.<pid>.partial``) left behind."""
    assert not (tmp_path / name).exists() and not list(tmp_path.glob(f".{name}*.partial"))


def test_missing_index_entry_fails_cleanly(tmp_path):
    _hf_llama().save_pretrained(tmp_path / "hf", max_shard_size="100KB")
    index_path = tmp_path / "hf" / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["model.layers.9.mlp.up_proj.weight"] = next(iter(index["weight_map"].values()))
    index_path.write_text(json.dumps(index))
    with pytest.raises(SeedckptError, match="lists tensors that its files do not contain"):
        convert(tmp_path / "hf", tmp_path / "out", "dcp", progress=False)
    _assert_nothing_written(tmp_path, "out")


def test_truncated_safetensors_fails_cleanly(tmp_path):
    _hf_llama().save_pretrained(tmp_path / "hf")
    [file] = (tmp_path / "hf").glob("*.safetensors")
    file.write_bytes(file.read_bytes()[:-1000])
    with pytest.raises(SeedckptError, match="is truncated"):
        convert(tmp_path / "hf", tmp_path / "out", "dcp", progress=False)
    _assert_nothing_written(tmp_path, "out")


def test_config_weights_mismatch_fails_cleanly(tmp_path):
    _hf_llama().save_pretrained(tmp_path / "hf")
    config_path = tmp_path / "hf" / "config.json"
    config = json.loads(config_path.read_text())
    config["num_hidden_layers"] = 4
    config_path.write_text(json.dumps(config))
    with pytest.raises(SeedckptError, match=r"layers\.3\.attention\.wq\.weight: missing"):
        convert(tmp_path / "hf", tmp_path / "out", "hf", progress=False)
    _assert_nothing_written(tmp_path, "out")


@pytest.mark.parametrize("source", ["hf", "foreign dcp"])
def test_an_integer_weight_is_refused_naming_tensor_and_file(tmp_path, debug_seed, source):
    """An int32 tensor under a weight's name (a quantized or crafted file) is not converted or
    loaded as if it were a weight."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file, save_file

    if source == "hf":
        _hf_llama().save_pretrained(tmp_path / "src", max_shard_size="100KB")
        file = next(
            f
            for f in sorted((tmp_path / "src").glob("*.safetensors"))
            if "model.layers.1.mlp.up_proj.weight" in load_file(f)
        )
        tensors = load_file(file)
        tensors["model.layers.1.mlp.up_proj.weight"] = tensors["model.layers.1.mlp.up_proj.weight"].to(torch.int32)
        save_file(tensors, file, metadata={"format": "pt"})
        expected = rf"layers\.1\.feed_forward\.w3\.weight: dtype int32 in {re.escape(str(file))}"
        config = []
    else:
        state = stock_load(debug_seed)
        state["layers.1.feed_forward.w3.weight"] = state["layers.1.feed_forward.w3.weight"].to(torch.int32)
        dcp.save(state, checkpoint_id=tmp_path / "src", no_dist=True)
        expected = rf"layers\.1\.feed_forward\.w3\.weight: dtype int32 in {re.escape(str(tmp_path / 'src'))}"
        config = ["--config", str(REPO / "configs/debug.toml")]
    assert main(["convert", str(tmp_path / "src"), str(tmp_path / "out"), "--to", "dcp", "--quiet", *config]) == 2
    _assert_nothing_written(tmp_path, "out")
    with pytest.raises(SeedckptError, match=expected + "; model weights are float32, bfloat16, float16, float64"):
        convert(
            tmp_path / "src",
            tmp_path / "out",
            "dcp",
            progress=False,
            args=tiny_config().model_args() if config else None,
        )


def test_a_failure_mid_write_leaves_no_output(tmp_path, debug_seed, monkeypatch):
    from seedckpt.checkpoint import DcpCheckpoint

    def broken(self, fqn, *rows):
        raise OSError("disk vanished")

    monkeypatch.setattr(DcpCheckpoint, "read_tensor", broken)
    monkeypatch.setattr(DcpCheckpoint, "read_rows", broken)
    for to, name in (("hf", "hf"), ("safetensors", "m.safetensors"), ("dcp", "dcp")):
        with pytest.raises((OSError, SeedckptError), match="disk vanished"):
            convert(debug_seed, tmp_path / name, to, progress=False)
        _assert_nothing_written(tmp_path, name)


def test_cli_errors_are_one_line(tmp_path, capsys):
    for args in (
        [str(tmp_path / "none"), str(tmp_path / "out"), "--to", "hf"],
        [str(tmp_path), str(tmp_path / "out"), "--to", "onnx"],
    ):
        assert main(["convert", *args]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2 and "no checkpoint at" in lines[0] and "--to 'onnx'" in lines[1]
    assert not any("Traceback" in line for line in lines)


def test_diff_treats_nan_in_different_places_as_a_difference(tmp_path, debug_seed):
    convert(debug_seed, tmp_path / "m.pt", "torch", progress=False)
    state = torch.load(tmp_path / "m.pt", weights_only=True)
    state["norm.weight"][0] = float("nan")
    torch.save(state, tmp_path / "nan.pt")
    equal, lines = diff(debug_seed, tmp_path / "nan.pt")
    assert not equal and "norm.weight: max |delta| 0 (NaN in different places)" in lines
    equal, _ = diff(tmp_path / "nan.pt", tmp_path / "nan.pt")
    assert equal


def test_torchtitan_03_checkpoints_load_convert_and_are_written(tmp_path, debug_seed):
    """A checkpoint in torchtitan 0.3's names (made with plain ``dcp.save``, as its checkpointer does)
    builds the same stages as our seed, converts to HF, and ours converts to its names."""
    import torch.distributed.checkpoint as dcp

    from models.llama3.torchtitan import to_torchtitan_name
    from seedckpt.checkpoint import DcpCheckpoint

    titan = {to_torchtitan_name(k): v for k, v in stock_load(debug_seed).items()}
    assert {"lm_head.weight", "layers.0.attention.qkv_linear.wq.weight"} <= set(titan)
    dcp.save(titan, checkpoint_id=str(tmp_path / "titan"), no_dist=True)
    args = tiny_config().model_args()
    for rank in range(2):  # the two stages of a pp=2 run
        specs = plan_rank_stages(args, rank, 2)
        [theirs] = build_stages(args, specs, "cpu", checkpoint=tmp_path / "titan")
        [ours] = build_stages(args, specs, "cpu", checkpoint=debug_seed)
        expected = ours.state_dict()
        assert all(torch.equal(t, expected[k]) for k, t in theirs.state_dict().items())
    convert(tmp_path / "titan", tmp_path / "hf", "hf", progress=False, args=args)
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    tokens = TOKENS % args.vocab_size
    with torch.no_grad():
        assert (hf(tokens).logits - our_logits(debug_seed, tokens)).abs().max().item() <= 1e-5
    convert(debug_seed, tmp_path / "to_titan", "torchtitan", progress=False)
    keys = set(DcpCheckpoint(tmp_path / "to_titan").metadata.state_dict_metadata)
    assert {"lm_head.weight", "layers.5.attention.qkv_linear.wk.weight"} <= keys and "output.weight" not in keys
    equal, lines = diff(debug_seed, tmp_path / "to_titan")
    assert equal, lines


def test_a_checkpoint_that_misses_the_model_names_what_it_has(tmp_path, debug_seed):
    import torch.distributed.checkpoint as dcp

    dcp.save(
        {f"model.{k}": v for k, v in stock_load(debug_seed).items()},
        checkpoint_id=str(tmp_path / "prefixed"),
        no_dist=True,
    )
    args = tiny_config().model_args()
    with pytest.raises(SeedckptError, match=r"it has 57 model tensors this model does not use, e.g. model\."):
        build_stages(args, plan_rank_stages(args, 1, 2), "cpu", checkpoint=tmp_path / "prefixed")


@pytest.mark.parametrize(
    "argv,message",
    [
        (["diff", "{seed}", "{seed}", "--atol", "nan"], "--atol nan: it must be a finite number >= 0"),
        (["diff", "{seed}", "{seed}", "--atol", "-1"], "--atol -1.0: it must be a finite number >= 0"),
        (["convert", "{seed}", "{out}", "--to", "hf", "--max-shard-size", "0"], "less than the largest tensor"),
        (["convert", "{seed}", "{out}", "--to", "hf", "--max-shard-size", "100KB"], "tok_embeddings.weight"),
    ],
)
def test_nonsense_numbers_are_refused_in_one_line(tmp_path, debug_seed, capsys, argv, message):
    argv = [a.format(seed=debug_seed, out=tmp_path / "out") for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("head", ["distinct", "a copy"])
def test_a_tied_config_over_a_stored_head_loads_as_transformers_does(tmp_path, tied_seed, head):
    """config.json ties the output, but the files also hold lm_head.weight: a copy of the embedding is
    the tie; a different head is kept, untied, with a warning -- transformers' logits, not 1.3 off."""
    from safetensors.torch import load_file, save_file

    out = convert(tied_seed, tmp_path / "hf", "hf", progress=False)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    [file] = set(index["weight_map"].values())
    tensors = load_file(out / file)
    embedding = tensors["model.embed_tokens.weight"]
    tensors["lm_head.weight"] = embedding + 0.5 if head == "distinct" else embedding.clone()
    save_file(tensors, out / file, metadata={"format": "pt"})
    index["weight_map"]["lm_head.weight"] = file
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    if head == "a copy":
        equal, lines = diff(tied_seed, out)
        assert equal, lines
        return
    with pytest.warns(UserWarning, match="store a distinct lm_head.weight: loaded untied, as transformers does"):
        dcp = convert(out, tmp_path / "dcp", "dcp", progress=False)
    reference = transformers.LlamaForCausalLM.from_pretrained(out).eval()
    tokens = TOKENS % reference.config.vocab_size
    with torch.no_grad():
        assert (our_logits(dcp, tokens) - reference(tokens).logits).abs().max().item() <= 1e-5


def test_float64_weights_are_refused_alike_until_convert_casts_them(tmp_path, capsys):
    """``convert`` (without ``--dtype``), ``load_model`` and a fine-tuning start refuse the same float64
    directory in one line, each naming the cast that lets it in; ``convert --dtype float32`` casts it
    (on request: the one rounding), and the result loads, computing the float64 model's logits."""
    from seedckpt import load_model
    from seedckpt.config.resolve import resolve

    f64, out = tmp_path / "f64", tmp_path / "f32"
    hf = _hf_llama().to(torch.float64)
    hf.save_pretrained(f64)
    refusal = rf"{re.escape(str(f64))} holds float64 weights \(\d+ tensors, e\.g\. \S+\), which models here hold in "
    refusal += "float32 at most: "
    capsys.readouterr()
    assert main(["convert", str(f64), str(out), "--to", "dcp", "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert re.search(refusal + "pass --dtype float32", err) and len(err.splitlines()) == 1, err
    assert not out.exists()
    sft = load_config(None, ["--finetune.mode", "sft", "--finetune.pretrained", str(f64)])
    for start, then in ((lambda: load_model(f64), "load OUT"), (lambda: resolve(sft, 1, 0), "fine-tune from OUT")):
        fix = f"cast it once: `seedckpt convert {f64} OUT --to dcp --dtype float32`, then {then}"
        with pytest.raises(SeedckptError, match=f"^{refusal}{re.escape(fix)}$"):
            start()
    assert main(["convert", str(f64), str(out), "--to", "dcp", "--dtype", "float32", "--quiet"]) == 0
    with torch.no_grad():
        assert (load_model(out)(TOKENS).double() - hf(TOKENS).logits).abs().max().item() <= 1e-5


@pytest.mark.parametrize(
    "settings,refusal",
    [
        ({"dtype": "int8"}, "dtype='int8': give one of float32, bfloat16, float16 (a name or a torch.dtype), or None"),
        ({"dtype": torch.int8}, "dtype=torch.int8: give one of float32, bfloat16, float16"),
        ({"dtype": torch.float64}, "dtype=torch.float64: give one of float32, bfloat16, float16"),
        ({"device": "gpu"}, "device='gpu' is not a device: give 'cpu', 'cuda' or 'cuda:N'"),
        ({"device": f"cuda:{torch.cuda.device_count()}"}, "CUDA device(s) on this machine"),  # one past the last
    ],
)
def test_load_model_takes_dtype_names_and_refuses_the_rest_in_one_line(debug_seed, settings, refusal):
    from seedckpt import load_model

    with pytest.raises(SeedckptError, match=re.escape(refusal)) as refused:
        load_model(debug_seed, **settings)
    assert "\n" not in str(refused.value)
    for name in ("bfloat16", "torch.bfloat16", torch.bfloat16):
        assert load_model(debug_seed, dtype=name).output.weight.dtype == torch.bfloat16


# Converts each seed to HF and back to DCP, diffs the two and verifies the HF directory's values, with
# slabs of 2 MiB; prints the process's peak RSS after each seed (an embedding of 16 MiB, then of 64 MiB).
PEAK_RSS_PROBE = """
import contextlib, io, resource, sys
import seedckpt.checkpoint.load as load
from seedckpt.cli.convert import convert, diff
from seedckpt.cli.main import main
load.SLAB_BYTES = 2 << 20
for seed in sys.argv[1:]:
    convert(seed, f"{seed}-hf", "hf", progress=False)
    convert(f"{seed}-hf", f"{seed}-dcp", "dcp", progress=False)
    assert diff(seed, f"{seed}-dcp")[0]
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["verify", f"{seed}-hf", "--quiet"]) == 0
    print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
"""


def test_peak_memory_of_convert_diff_and_verify_does_not_grow_with_the_tensor(tmp_path):
    """A tied embedding of 16 MiB, then 64 MiB, through both writers and readers (HF, DCP), diff and
    verify: the peak RSS grows by less than a quarter of the difference, so no tensor is ever held
    whole (held whole, it grew by 540 MiB: read, cast and diff's float64 copies)."""
    seeds = []
    for vocab in (32768, 131072):
        cfg = tiny_config(
            "--model.vocab_size", str(vocab), "--model.n_layers", "1", "--model.tie_word_embeddings", "true"
        )
        seeds.append(str(create_seed_checkpoint(cfg, tmp_path / str(vocab), seed=0, progress=False, workers=1)))
    small, large = probe_readings(PEAK_RSS_PROBE, *seeds)
    assert large - small < 12 << 20, f"peak RSS {small / 2**20:.0f} MiB -> {large / 2**20:.0f} MiB"


def test_a_conversion_beyond_the_available_memory_is_refused_before_writing(tmp_path, debug_seed, monkeypatch):
    """With 1 MiB available, ``--to torch`` (one pickle of every tensor) is refused in one line naming
    the fix; ``--to safetensors`` goes a slab at a time. With slabs of 1 KiB and 12 KiB available, HF's
    RoPE permutation holds whole heads of q and k (16 rows: 16 KiB read and cast), refused naming one."""
    monkeypatch.setattr(convert_module, "available_memory", lambda: 1 << 20)
    with pytest.raises(SeedckptError, match="--to torch pickles every tensor at once.*--to safetensors") as e:
        convert(debug_seed, tmp_path / "m.pt", "torch", progress=False)
    assert "\n" not in str(e.value)
    _assert_nothing_written(tmp_path, "m.pt")
    convert(debug_seed, tmp_path / "m.safetensors", "safetensors", progress=False)
    monkeypatch.setattr(slabs, "SLAB_BYTES", 1 << 10)  # every other tensor holds 2.8 KiB at most
    monkeypatch.setattr(convert_module, "available_memory", lambda: 12 << 10)
    with pytest.raises(SeedckptError, match=r"attention.w[qk].weight is held in slabs of the row groups its target"):
        convert(debug_seed, tmp_path / "hf", "hf", progress=False)
    _assert_nothing_written(tmp_path, "hf")


@pytest.mark.parametrize("to, name", [("hf", "hf"), ("dcp", "dcp"), ("safetensors", "m.safetensors")])
def test_a_conversion_larger_than_the_free_disk_is_refused_before_writing(tmp_path, debug_seed, monkeypatch, to, name):
    """With one byte less free than the output it then writes (tensors, headers, index, manifest,
    tokenizer), the conversion is refused in one line naming the fix, nothing written: the estimate
    covers every byte, so hours of a large conversion never end in a full disk."""
    written = convert(debug_seed, tmp_path / "whole" / name, to, progress=False)
    size = sum(f.stat().st_size for f in [written, *written.rglob("*")] if f.is_file())
    real = resources.shutil.disk_usage
    monkeypatch.setattr(resources.shutil, "disk_usage", lambda p: real(p)._replace(free=size - 1))
    with pytest.raises(SeedckptError, match=f"the {to} conversion needs .* free; free space, choose another") as e:
        convert(debug_seed, tmp_path / name, to, progress=False)
    assert "\n" not in str(e.value)
    _assert_nothing_written(tmp_path, name)


def test_a_diff_beyond_the_available_memory_is_refused_before_comparing(debug_seed, monkeypatch):
    """With 1 MiB available, a diff in 32 MiB slabs (each tensor of the debug model one slab: the
    embedding's 64 K values at 52 bytes each, two reads, float64 copies and masks, 3.25 MiB) is refused
    in one line naming the tensor; in slabs of 16 KiB (16 rows, 104 KiB held) the same diff runs."""
    monkeypatch.setattr(convert_module, "available_memory", lambda: 1 << 20)
    with pytest.raises(
        SeedckptError,
        match=r"tok_embeddings.weight takes 3.2 MiB at once .* 1.0 MiB of memory are available: free memory",
    ) as e:
        diff(debug_seed, debug_seed)
    assert "\n" not in str(e.value)
    monkeypatch.setattr(slabs, "SLAB_BYTES", 16 << 10)
    assert diff(debug_seed, debug_seed)[0]


def test_the_memory_estimate_counts_the_whole_heads_an_hf_read_widens_a_slab_to(tmp_path, debug_seed, monkeypatch):
    """Read from HF, q and k come in whole RoPE heads (16 rows of 512 bytes) kept while their slab
    lives: in slabs of 1 KiB (2 rows; every other tensor holds 2.8 KiB at most, read and cast) with
    4 KiB available, HF -> DCP is refused naming one (8 KiB read, 1 KiB cast), nothing written; diff's
    estimate of q against the seed counts the 8 KiB as well (a row of 128 values compared: 6.5 KiB)."""
    hf = convert(debug_seed, tmp_path / "hf", "hf", progress=False)
    monkeypatch.setattr(slabs, "SLAB_BYTES", 1 << 10)
    monkeypatch.setattr(convert_module, "available_memory", lambda: 4 << 10)
    with pytest.raises(SeedckptError, match=r"attention.w[qk].weight is held in slabs widened to the row groups"):
        convert(hf, tmp_path / "dcp", "dcp", progress=False)
    _assert_nothing_written(tmp_path, "dcp")
    sides = [open_model_checkpoint(path) for path in (hf, debug_seed)]
    assert convert_module._diff_held(*sides, "layers.0.attention.wq.weight") > 8 << 10


def test_a_verify_beyond_the_available_memory_is_refused_before_reading(tmp_path, debug_seed, monkeypatch, capsys):
    """``verify`` of a file without checksums reads every value a slab at a time, a row never split:
    in slabs of 1 KiB, w2's rows of 1408 bytes take more than 1 KiB available, so it exits 2 with one
    line naming the tensor and the fix; with 2 KiB available it reads every value."""
    checkpoint = str(convert(debug_seed, tmp_path / "m.safetensors", "safetensors", progress=False))
    monkeypatch.setattr(slabs, "SLAB_BYTES", 1 << 10)
    monkeypatch.setattr(convert_module, "available_memory", lambda: 1 << 10)
    assert main(["verify", checkpoint, "--quiet"]) == 2
    error = capsys.readouterr().err
    assert re.fullmatch(r"seedckpt verify: error: verify of .*w2.weight takes .* at once .* free memory.*\n", error)
    monkeypatch.setattr(convert_module, "available_memory", lambda: 2 << 10)
    assert main(["verify", checkpoint, "--quiet"]) == 0


class _ReadWhole(OpenedCheckpoint):
    """A format that reads a tensor only whole (``read_tensor``), counting its reads."""

    def __init__(self, shape: tuple[int, ...]):
        super().__init__(Path("whole"), {"w": TensorInfo(shape, torch.float32)}, None)
        self.reads = 0

    def read_tensor(self, fqn: str) -> torch.Tensor:
        self.reads += 1
        return torch.arange(float(self.infos[fqn].numel)).reshape(self.infos[fqn].shape)


def test_a_tensor_read_only_whole_is_read_once_and_dropped_after_its_last_slab():
    """Read in slabs of 4 rows, a tensor its format reads only whole is read once for all of them,
    and once its last slab is freed nothing holds it (it was kept until another tensor was read, so
    a conversion's last dense OSFT weight stayed in memory to the end)."""
    reader = _ReadWhole((10, 3))
    slabs_read = list(reader.slabs("w", [(0, 4), (4, 8), (8, 10)]))
    assert reader.reads == 1 and torch.equal(torch.cat(slabs_read), reader.read_tensor("w"))
    whole = weakref.ref(slabs_read[0]._base)
    del slabs_read
    assert whole() is None


def _fake_memory(root: Path, files: dict[str, str]) -> Path:
    """A ``/proc/meminfo`` (8 GiB available), ``/proc/self/cgroup`` (``self``) and cgroup folder
    (``cg``) under ``root`` holding ``files``."""
    for name, text in {"meminfo": "MemTotal: 67108864 kB\nMemAvailable: 8388608 kB\n", **files}.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


V1 = "cg/memory/memory.limit_in_bytes", "cg/memory/memory.usage_in_bytes"


@pytest.mark.parametrize(
    "files, gib",
    [
        ({}, 8.0),  # no cgroup: MemAvailable's 8 GiB
        ({"cg/memory.max": "max\n", "cg/memory.current": str(6 << 30)}, 8.0),  # v2 without a limit
        ({"cg/memory.max": str(2 << 30), "cg/memory.current": str(3 << 29)}, 0.5),  # v2: the limit less usage
        (  # its inactive page cache is reclaimed before the OOM killer comes
            {
                "cg/memory.max": str(2 << 30),
                "cg/memory.current": str(2 << 30),
                "cg/memory.stat": "inactive_file 1073741824\n",
            },
            1.0,
        ),
        (  # a limit on the slice above this process's own cgroup (named in /proc/self/cgroup)
            {"self": "0::/slice/job\n", "cg/slice/memory.max": str(1 << 30), "cg/slice/memory.current": str(1 << 28)}
            | {"cg/slice/job/memory.max": "max", "cg/slice/job/memory.current": "1"},
            0.75,
        ),
        (dict(zip(V1, (str(1 << 30), str(1 << 28)))), 0.75),  # v1's memory controller
        (dict(zip(V1, (str(2**63 - 4096), "1"))), 8.0),  # v1 without a limit
    ],
)
def test_available_memory_is_the_cgroup_limits_room_where_it_leaves_less(tmp_path, files, gib):
    """In a container MemAvailable is the host's: a cgroup limit (v2 or v1) of 2 GiB with 1.5 in use
    leaves 0.5 GiB, whatever the host has free, and the up-front memory refusals count that."""
    root = _fake_memory(tmp_path, files)
    assert resources.available_memory(root / "meminfo", root / "cg", root / "self") == gib * 2**30


def test_conversions_in_slabs_of_a_few_rows_are_bitwise_the_whole_tensors(tmp_path, monkeypatch):
    """Slabs of 8 KiB (a few rows, a few experts, whole RoPE heads of q and k) through every reader and
    writer of a mixture of experts: the HF and safetensors files are byte for byte those written with a
    slab per tensor (the tensors' bytes), and DCP in ours and torchtitan's names (q/k rows permuted)
    diff equal to the seed."""
    cfg = tiny_config("--model.name", "qwen3_moe", "--model.n_layers", "2")
    seed = create_seed_checkpoint(cfg, tmp_path / "seed", seed=0, progress=False, workers=1)
    for to, name in (("hf", "hf"), ("safetensors", "m.safetensors")):
        convert(seed, tmp_path / f"whole-{name}", to, progress=False)
    monkeypatch.setattr(slabs, "SLAB_BYTES", 8 << 10)
    for to, name in (("hf", "hf"), ("safetensors", "m.safetensors")):
        convert(seed, tmp_path / name, to, progress=False)
        assert _safetensors_bytes(tmp_path / name) == _safetensors_bytes(tmp_path / f"whole-{name}")
    for source, to in (("hf", "dcp"), ("m.safetensors", "torchtitan")):
        convert(tmp_path / source, tmp_path / to, to, progress=False)
        equal, lines = diff(seed, tmp_path / to)
        assert equal, lines


def _safetensors_bytes(path: Path) -> list[bytes]:
    """The tensors' bytes (all after the header, which holds the manifest's time) of a safetensors file,
    or of each shard of a directory, in name order."""
    blobs = [f.read_bytes() for f in (sorted(path.glob("*.safetensors")) if path.is_dir() else [path])]
    return [blob[8 + int.from_bytes(blob[:8], "little") :] for blob in blobs]
