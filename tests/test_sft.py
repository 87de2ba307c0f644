"""SFT from Hugging Face or DCP checkpoints through the stage path: cross-layout parity, export that
``transformers`` loads, per-rank reads, vocabulary growth across shards, resume, and bad input."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from models.common.hf_names import from_hf_name
from seedckpt.cli.convert import convert
from seedckpt.cli.main import main as seedckpt
from seedckpt.materialize.model_checkpoint import open_model_checkpoint
from seedckpt.materialize.stages import build_stages
from seedckpt.parallel.pipeline import plan_rank_stages
from tests.dist import run_distributed, run_main
from tests.tiny_tokenizers import build_tiny_tokenizer, make_chats

transformers = pytest.importorskip("transformers")
REPO = Path(__file__).resolve().parents[1]


def _hf_llama(path: Path, vocab_size: int, tie: bool) -> Path:
    """A small random LlamaForCausalLM (GQA) saved as an HF directory, built offline."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=256,
        tie_word_embeddings=tie,
    )
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.05) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def chat_inputs(tmp_path_factory):
    """A tokenizer (with a chat template) and a memorizable chat file."""
    root = tmp_path_factory.mktemp("chat")
    chats = make_chats(48, seed=0)
    corpus = [m["content"] for c in chats for m in c["messages"]]
    tokenizer = build_tiny_tokenizer(root / "tokenizer", corpus, vocab_size=300)
    path = root / "chats.jsonl"
    path.write_text("".join(json.dumps(c) + "\n" for c in chats))
    return tokenizer, path, len(transformers.AutoTokenizer.from_pretrained(tokenizer))


def sft(
    run_dir: Path, pretrained: Path, tokenizer: Path, chats: Path, nproc: int, *overrides: str, check: bool = True
) -> subprocess.CompletedProcess:
    argv = [
        "--config",
        "configs/sft_debug.toml",
        "--finetune.pretrained",
        str(pretrained),
        "--data.tokenizer",
        str(tokenizer),
        "--data.path",
        str(chats),
        "--checkpoint.folder",
        str(run_dir / "ckpt"),
        "--job.dump_folder",
        str(run_dir),
        "--training.steps",
        "10",
        "--training.seq_len",
        "64",
        "--training.global_batch_size",
        "8",
        "--training.warmup_steps",
        "2",
        "--checkpoint.interval",
        "10",
        *overrides,
    ]
    proc = run_main(argv, nproc, {**os.environ, "OMP_NUM_THREADS": "1"}, REPO)
    if check:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def losses(run_dir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


SINGLE = ["--parallelism.pipeline_parallel_degree", "1", "--training.local_batch_size", "8"]
PP2_DP2 = [
    "--parallelism.pipeline_parallel_degree",
    "2",
    "--training.local_batch_size",
    "4",
    "--parallelism.pipeline_parallel_microbatches",
    "2",
]
ZBV = [
    "--parallelism.pipeline_parallel_degree",
    "2",
    "--training.local_batch_size",
    "8",
    "--parallelism.pipeline_parallel_schedule",
    "ZBVZeroBubble",
    "--parallelism.pipeline_parallel_stages_per_rank",
    "2",
    "--parallelism.pipeline_parallel_microbatches",
    "4",
]


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_sft_from_hf_parity_export_and_transformers_agree(tmp_path, chat_inputs, tie):
    tokenizer, chats, tokenizer_vocab = chat_inputs
    # The tied model's vocabulary is smaller than the tokenizer's, so it also grows (to a multiple of 8).
    vocab = tokenizer_vocab - 21 if tie else -(-tokenizer_vocab // 8) * 8
    hf = _hf_llama(tmp_path / "hf", vocab, tie)
    single = sft(tmp_path / "single", hf, tokenizer, chats, 1, *SINGLE)
    sft(tmp_path / "split", hf, tokenizer, chats, 4, *PP2_DP2)
    layouts = ["split"]
    if tie:  # ZBV puts the first and the last stage on rank 0: its tied copies are summed locally
        sft(tmp_path / "zbv", hf, tokenizer, chats, 2, *ZBV)
        layouts.append("zbv")
    assert "starting from pretrained" in single.stdout
    reference = losses(tmp_path / "single")
    for layout in layouts:
        got = losses(tmp_path / layout)
        assert len(reference) == len(got) == 10
        for step, (a, b) in enumerate(zip(got, reference), start=1):
            assert abs(a - b) <= 1e-5 * abs(b), f"{layout} step {step}: {a} vs {b}"
    assert reference[-1] < reference[0] - 0.5  # the masked loss falls

    step = tmp_path / "split" / "ckpt" / "step-10"
    args = open_model_checkpoint(step).args
    assert args.tie_word_embeddings == tie and args.vocab_size == -(-tokenizer_vocab // 8) * 8
    convert(step, tmp_path / "export", "hf", progress=False)
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    assert config["tie_word_embeddings"] == tie and config["vocab_size"] == args.vocab_size
    assert (tmp_path / "export" / "tokenizer.json").is_file()
    index = json.loads((tmp_path / "export" / "model.safetensors.index.json").read_text())
    assert ("lm_head.weight" in index["weight_map"]) != tie
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "export")  # the tokenizer travels with it
    # generate() stops at the end of a turn: the eos ids hold the token the template closes the
    # assistant's part with (the one SFT taught), in config.json and generation_config.json
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}])
    rendered = rendered["input_ids"] if hasattr(rendered, "keys") else rendered
    end_of_turn = next(t for t in reversed(rendered) if t in tokenizer.all_special_ids and t != tokenizer.pad_token_id)
    generation = transformers.GenerationConfig.from_pretrained(tmp_path / "export")
    assert end_of_turn in generation.eos_token_id and end_of_turn in config["eos_token_id"]
    assert exported.generation_config.eos_token_id == generation.eos_token_id
    tokens = torch.randint(0, args.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    [ours] = build_stages(args, plan_rank_stages(args, 0, 1), "cpu", checkpoint=step)
    with torch.no_grad():
        assert (exported(tokens).logits - ours(tokens)).abs().max().item() <= 1e-5


def _read_recording_worker(rank, world_size, hf_dir, dcp_dir):
    """pp=2 x dp_shard=2 stages built from an HF dir and from a DCP dir, recording every read request."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from seedckpt.checkpoint.owned_reads import OwnedFileSystemReader, OwnedHFReader
    from seedckpt.utils.tensors import local_rows

    reads = []
    for cls in (OwnedHFReader, OwnedFileSystemReader):
        original = cls.read_data

        def recording(self, plan, planner, original=original):
            for item in plan.items:
                start = item.storage_index.offset[0] + item.storage_offsets[0] if item.storage_index.offset else 0
                reads.append((item.storage_index.fqn, start, start + item.lengths[0]))
            return original(self, plan, planner)

        cls.read_data = recording

    args = open_model_checkpoint(dcp_dir).args
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp_shard"))
    specs = plan_rank_stages(args, mesh.get_local_rank("pp"), 2)
    out = {}
    for name, path in (("hf", hf_dir), ("dcp", dcp_dir)):
        reads.clear()
        [stage] = build_stages(
            args, specs, "cpu", checkpoint=path, shard_fn=lambda m: fully_shard(m, mesh=mesh["dp_shard"])
        )
        owned = {fqn: local_rows(t) for fqn, t in stage.state_dict().items()}
        out[name] = (owned, list(reads))
    return out


def test_each_rank_reads_only_its_stage_and_rows(tmp_path):
    hf = _hf_llama(tmp_path / "hf", 256, tie=False)
    convert(hf, tmp_path / "dcp", "dcp", progress=False)
    head_rows = 64 // 8
    for rank, result in enumerate(run_distributed(_read_recording_worker, 4, str(hf), str(tmp_path / "dcp"))):
        for name, (owned, reads) in result.items():
            fqns = {from_hf_name(f) if name == "hf" else f for f, _, _ in reads}
            assert fqns == set(owned), f"rank {rank} {name}: read {sorted(fqns ^ set(owned))} it does not own"
            assert len(owned) <= 2 * 9 + 2  # a stage (2 blocks + embedding or norm and output), not 39 tensors
            for fqn, lo, hi in reads:
                fqn = from_hf_name(fqn) if name == "hf" else fqn
                start, stop = owned[fqn]
                if name == "hf" and (".wq." in fqn or ".wk." in fqn):  # whole RoPE heads around the shard
                    start, stop = start // head_rows * head_rows, -(-stop // head_rows) * head_rows
                assert start <= lo and hi <= stop, f"rank {rank} {name} {fqn}: rows {lo}..{hi} beyond {start}..{stop}"


# Four ranks at most; tp2 alone on two. (pp, dp_replicate, dp_shard, tp)
GROWTH_LAYOUTS = {
    "pp2 x dp_shard2": (2, 1, 2, 1),
    "tp2": (1, 1, 1, 2),
    "tp2 x dp_shard2": (1, 1, 2, 2),
    "pp2 x tp2": (2, 1, 1, 2),
    "dp_replicate2 x tp2": (1, 2, 1, 2),
}
GROWN_VOCAB = 128  # from 40: under tp2 x dp_shard2 two of the four 32-row blocks hold only new rows


def _grown_args(sources: dict, name: str):
    """The model of source ``name`` with the grown vocabulary (direct init: the untied model's)."""
    import dataclasses

    return dataclasses.replace(open_model_checkpoint(sources[name] or sources["hf"]).args, vocab_size=GROWN_VOCAB)


def _stage_blocks(args, checkpoint, specs, shard_fn=None) -> dict:
    """Every tensor of the stage built from ``checkpoint`` (growing the vocabulary; ``None``: direct
    init), as this rank's block of it: ``{fqn: (offsets of the block in the full tensor, block)}``."""
    from seedckpt.utils.tensors import local, local_block

    [stage] = build_stages(
        args,
        specs,
        "cpu",
        checkpoint=checkpoint,
        seed=7 if checkpoint is None else None,
        grow_vocab=checkpoint is not None,
        shard_fn=shard_fn,
    )
    return {fqn: (local_block(t)[0], local(t).detach().clone()) for fqn, t in stage.state_dict().items()}


def _growth_layout_worker(rank, world_size, sources, degrees):
    """Each source's stage on this rank of the layout ``degrees``, parallelized as ``train.py`` does."""
    from seedckpt.parallel.data_parallel import make_data_parallel
    from seedckpt.parallel.parallelize import ParallelDims, parallelize_stage
    from tests.conftest import tiny_config

    dims = ParallelDims(*degrees)
    mesh = dims.build_mesh("cpu")
    cfg = tiny_config()  # what parallelize_stage reads besides the model: sequence parallel on, fp32, no AC
    data_parallel = make_data_parallel(cfg, dims, mesh)
    out = {}
    for name, checkpoint in sources.items():
        args = _grown_args(sources, name)
        specs = plan_rank_stages(args, mesh.get_local_rank("pp"), dims.pp)
        out[name] = _stage_blocks(
            args, checkpoint, specs, lambda m: parallelize_stage(m, cfg, dims, mesh, data_parallel.shard_on_meta)
        )
    return out


@pytest.fixture(scope="module")
def growth_sources(tmp_path_factory):
    """Untied and tied models with a vocabulary of 40, as HF directories and as DCP checkpoints (and
    direct init, ``None``), and each one's stage built by one process, its vocabulary grown to 128."""
    root = tmp_path_factory.mktemp("growth")
    sources = {}
    for tied in ("", "tied "):
        hf = _hf_llama(root / f"{tied}hf", 40, tie=bool(tied))
        sources[f"{tied}hf"] = str(hf)
        sources[f"{tied}dcp"] = str(convert(hf, root / f"{tied}dcp", "dcp", progress=False))
    sources["direct init"] = None
    one_process = {}
    for name, checkpoint in sources.items():
        args = _grown_args(sources, name)
        blocks = _stage_blocks(args, checkpoint, plan_rank_stages(args, 0, 1))
        one_process[name] = {fqn: block for fqn, (_, block) in blocks.items()}
    return sources, one_process


def test_one_process_grows_the_vocabulary_with_the_mean_of_the_old_rows(growth_sources):
    sources, one_process = growth_sources
    for name, checkpoint in sources.items():
        if checkpoint is None:
            continue
        reader = open_model_checkpoint(checkpoint)
        for fqn in ("tok_embeddings.weight", "output.weight"):
            grown, old = one_process[name][fqn], reader.read_tensor(fqn)
            assert torch.equal(grown[:40], old), (name, fqn)  # bitwise the checkpoint's rows
            mean = old.double().mean(0).float()
            torch.testing.assert_close(grown[40:], mean.expand(GROWN_VOCAB - 40, -1), rtol=0, atol=1e-7)
        if name.startswith("tied"):
            assert torch.equal(one_process[name]["output.weight"], one_process[name]["tok_embeddings.weight"])


@pytest.mark.parametrize("layout", GROWTH_LAYOUTS)
def test_every_layout_loads_a_grown_vocabulary_bitwise_like_one_process(growth_sources, layout):
    """Every tensor of every rank's block, untied and tied, read from HF and DCP (and direct init),
    equals one process's bitwise; the blocks cover each tensor. Under tp2 x dp_shard2 the vocabulary
    is split over two mesh dimensions (FSDP's ``_StridedShard`` and TP's ``Shard``): the mean of the
    old rows summed over only one of them gave the new rows other values."""
    sources, one_process = growth_sources
    degrees = GROWTH_LAYOUTS[layout]
    results = run_distributed(_growth_layout_worker, math.prod(degrees), sources, degrees)
    for name, reference in one_process.items():
        covered = {fqn: torch.zeros(t.shape, dtype=torch.bool) for fqn, t in reference.items()}
        for rank, result in enumerate(results):
            for fqn, (offsets, block) in result[name].items():
                where = tuple(slice(o, o + n) for o, n in zip(offsets, block.shape))
                assert torch.equal(block, reference[fqn][where]), f"{layout}, rank {rank}, {name}: {fqn}"
                covered[fqn][where] = True
        assert all(mask.all() for mask in covered.values()), f"{layout}, {name}: tensors not covered"


# SFT of a debug checkpoint (vocabulary 512) on the shipped chats, whose tokenizer has 600 tokens.
SHIPPED = REPO / "configs" / "sft_demo"
TP2 = ["--parallelism.tensor_parallel_degree", "2"]
GROWN_SFT_LAYOUTS = {  # four ranks each, global batch 8
    "tp2 x dp_shard2": [*TP2, "--parallelism.pipeline_parallel_degree", "1", "--training.local_batch_size", "4"],
    "pp2 x tp2": [*TP2, "--parallelism.data_parallel_shard_degree", "1", "--training.local_batch_size", "8"],
    "dp_replicate2 x tp2": [
        *TP2,
        "--parallelism.pipeline_parallel_degree",
        "1",
        "--parallelism.data_parallel_replicate_degree",
        "2",
        "--training.local_batch_size",
        "4",
    ],
    "pp2 x dp_shard2": PP2_DP2,
}


@pytest.fixture(scope="module")
def one_process_step(tmp_path_factory, debug_seed, tied_seed):
    """``(tied, mode)`` -> step 1's loss and gradient norm of one process (each run once)."""
    runs = {}

    def step(tied: bool, mode: str) -> tuple[float, float]:
        if (tied, mode) not in runs:
            run_dir = tmp_path_factory.mktemp("one_process")
            runs[tied, mode] = _grown_sft_step(run_dir, tied_seed if tied else debug_seed, mode, 1, SINGLE)
        return runs[tied, mode]

    return step


def _grown_sft_step(run_dir: Path, pretrained: Path, mode: str, nproc: int, layout: list[str]) -> tuple[float, float]:
    step_1 = ["--training.steps", "1", "--checkpoint.enable", "false", "--finetune.mode", mode]
    sft(run_dir, pretrained, SHIPPED / "tokenizer", SHIPPED / "chats.jsonl", nproc, *layout, *step_1)
    [row] = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return row["loss"], row["grad_norm"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout, tied, mode",
    [
        ("tp2 x dp_shard2", False, "sft"),
        ("pp2 x tp2", True, "sft"),
        ("dp_replicate2 x tp2", True, "sft"),
        ("pp2 x dp_shard2", False, "osft"),
    ],
)
def test_a_grown_vocabulary_trains_like_one_process(
    tmp_path, debug_seed, tied_seed, one_process_step, layout, tied, mode
):
    """Step 1 of fine-tuning with the vocabulary grown from 512 to 600: the loss and the gradient
    norm of each layout within 1e-5 of one process's (tied and untied, SFT and OSFT where it runs).
    Under tp2 x dp_shard2 the new rows' mean was summed over the TP ranks only, so the step trained
    another model; under pp2 x tp2 with tied embeddings the embedding's gradient is replicated while
    its output copy's is split by rows, and the tied pair's gradient sum failed."""
    pretrained = tied_seed if tied else debug_seed
    loss, norm = _grown_sft_step(tmp_path, pretrained, mode, 4, GROWN_SFT_LAYOUTS[layout])
    want_loss, want_norm = one_process_step(tied, mode)
    assert abs(loss - want_loss) <= 1e-5 * want_loss, (loss, want_loss)
    assert abs(norm - want_norm) <= 1e-5 * want_norm, (norm, want_norm)


def _tokenizer_with_max_length(tokenizer: Path, to: Path, model_max_length: int) -> Path:
    """A copy of ``tokenizer`` whose ``model_max_length`` is small: transformers logs a warning
    ("Token indices sequence length is longer ...") when it encodes a longer conversation."""
    shutil.copytree(tokenizer, to)
    config = json.loads((to / "tokenizer_config.json").read_text())
    (to / "tokenizer_config.json").write_text(json.dumps({**config, "model_max_length": model_max_length}))
    return to


def test_resume_mid_epoch_gives_identical_losses(tmp_path, chat_inputs):
    tokenizer, chats, tokenizer_vocab = chat_inputs
    tokenizer = _tokenizer_with_max_length(tokenizer, tmp_path / "tokenizer", 16)
    hf = _hf_llama(tmp_path / "hf", -(-tokenizer_vocab // 8) * 8, tie=True)
    layout = [
        "--parallelism.pipeline_parallel_degree",
        "2",
        "--training.local_batch_size",
        "8",
        "--checkpoint.interval",
        "4",
    ]
    straight = sft(tmp_path / "straight", hf, tokenizer, chats, 2, *layout)
    # transformers' logs come from rank 0 only: every rank loads the same tokenizer and data.
    assert (straight.stdout + straight.stderr).count("Token indices sequence length is longer") == 1
    rows_per_epoch = int(straight.stdout.split(" rows per epoch")[0].split()[-1])
    assert 4 * 8 % rows_per_epoch, "step 4 must end mid-epoch"
    first = sft(tmp_path / "resumed", hf, tokenizer, chats, 2, *layout, "--training.stop_after_step", "5")
    assert "stopping after step 5" in first.stdout
    second = sft(tmp_path / "resumed", hf, tokenizer, chats, 2, *layout)
    assert "resuming from" in second.stdout
    assert losses(tmp_path / "resumed") == losses(tmp_path / "straight")


def _train_error(tmp_path: Path, *argv: str) -> str:
    """``train.py`` with the SFT config, its outputs in ``tmp_path`` (never the working tree's
    ``outputs/``, which the README's examples fill): the one-line error it stops with."""
    outputs = ["--checkpoint.folder", str(tmp_path / "ckpt"), "--job.dump_folder", str(tmp_path / "run")]
    proc = run_main(["--config", "configs/sft_debug.toml", *outputs, *argv], 1, dict(os.environ), REPO)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    return proc.stderr


def test_bad_input_fails_before_training_with_one_line(tmp_path, chat_inputs):
    tokenizer, chats, tokenizer_vocab = chat_inputs
    hf = _hf_llama(tmp_path / "hf", 320, tie=False)
    common = [
        "--finetune.pretrained",
        str(hf),
        "--data.tokenizer",
        str(tokenizer),
        "--parallelism.pipeline_parallel_degree",
        "1",
    ]
    err = _train_error(tmp_path, *common, "--data.path", str(chats), "--model.dim", "128")
    assert "model.dim = 128 (the checkpoint: 64)" in err and "would change the tensors of finetune.pretrained" in err
    err = _train_error(tmp_path, *common, "--data.path", str(chats), "--model.flavor", "1B")
    assert "model.flavor = '1B' has dim = 2048, the checkpoint 64" in err
    broken = tmp_path / "broken.jsonl"
    broken.write_text(chats.read_text().splitlines()[0] + "\n{not json\n")
    assert f"{broken}:2" in _train_error(tmp_path, *common, "--data.path", str(broken))
    err = _train_error(
        tmp_path,
        "--finetune.pretrained",
        str(tmp_path / "nowhere"),
        "--data.tokenizer",
        str(tokenizer),
        "--data.path",
        str(chats),
    )
    assert "does not exist" in err


def test_a_fine_tuning_start_opens_the_pretrained_checkpoint_once(tmp_path, chat_inputs, monkeypatch):
    """``resolve`` opens ``finetune.pretrained`` for its args; the start (and so the stage builder)
    uses that same object instead of opening it again."""
    from seedckpt.config.job_config import load_config
    from seedckpt.config.resolve import resolve
    from seedckpt.materialize import model_checkpoint

    tokenizer, chats, vocab = chat_inputs
    hf = _hf_llama(tmp_path / "hf", vocab, tie=False)
    opened = []
    real = model_checkpoint.open_checkpoint
    monkeypatch.setattr(model_checkpoint, "open_checkpoint", lambda *a, **k: opened.append(a[0]) or real(*a, **k))
    monkeypatch.chdir(REPO)
    cfg = load_config(
        "configs/sft_debug.toml",
        ["--finetune.pretrained", str(hf), "--data.tokenizer", str(tokenizer), "--data.path", str(chats)]
        + ["--checkpoint.folder", str(tmp_path / "ckpt"), "--parallelism.pipeline_parallel_degree", "1"],
    )
    run = resolve(cfg, 1).with_start()
    assert opened == [str(hf)]
    assert run.start.checkpoint is run.pretrained and run.start.pretrained


def test_token_budget_batches_fill_rows_and_train_alike_on_one_process_and_pp2_x_dp2(tmp_path, chat_inputs):
    """``training.max_tokens_per_rank = 512`` over ``local_batch_size = 2``: each micro-batch is two rows
    of 256 tokens packed with whole conversations (each at most seq_len = 64 tokens) -- less padding
    than rows of 64 -- and a step of 4 such rows gives the same losses on one process (accumulating)
    and on pp 2 x dp_shard 2 (each rank's two rows are the pipeline's two micro-batches)."""
    tokenizer, chats, vocab = chat_inputs
    hf = _hf_llama(tmp_path / "hf", -(-vocab // 8) * 8, tie=False)
    budget = ["--training.max_tokens_per_rank", "512", "--training.local_batch_size", "2"]
    budget += ["--training.global_batch_size", "4", "--training.steps", "4"]
    one = sft(tmp_path / "one", hf, tokenizer, chats, 1, *budget, "--parallelism.pipeline_parallel_degree", "1")
    four = sft(tmp_path / "four", hf, tokenizer, chats, 4, *budget, "--parallelism.pipeline_parallel_degree", "2")
    assert "into rows of 256 tokens (training.max_tokens_per_rank)" in one.stdout, one.stdout
    assert "mesh pp=2 dp_replicate=1 dp_shard=2" in four.stdout, four.stdout
    assert len(losses(tmp_path / "one")) == 4
    for a, b in zip(losses(tmp_path / "one"), losses(tmp_path / "four"), strict=True):
        assert a == pytest.approx(b, rel=1e-5)
    # The chats tokenized once (`seedckpt tokenize --chat`) train to the very same losses.
    chat_tokens = ["tokenize", str(chats), "--chat", "--tokenizer", str(tokenizer), "--quiet"]
    assert seedckpt([*chat_tokens, "--output", str(tmp_path / "chat_tokens")]) == 0
    tokens = ["--data.kind", "tokens", "--data.path", str(tmp_path / "chat_tokens")]
    pretokenized = sft(tmp_path / "tokens", hf, tokenizer, chats, 1, *budget, *SINGLE[:2], *tokens)
    assert f"data: chat tokens {tmp_path / 'chat_tokens'}: 48 conversations" in pretokenized.stdout
    assert losses(tmp_path / "tokens") == losses(tmp_path / "one")

    def padding(stdout: str) -> float:
        return float(stdout.split("% padding")[0].split()[-1])

    rows_of_64 = sft(
        tmp_path / "rows64",
        hf,
        tokenizer,
        chats,
        1,
        "--training.steps",
        "1",
        "--parallelism.pipeline_parallel_degree",
        "1",
    )
    assert padding(one.stdout) < padding(rows_of_64.stdout)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["--training.max_tokens_per_rank", "64", "--training.local_batch_size", "2"], "hold training.seq_len = 64"),
        (["--training.max_tokens_per_rank", "257", "--training.local_batch_size", "2"], "a multiple of training.local"),
        (
            ["--training.max_tokens_per_rank", "256", "--data.packing", "false"],
            "needs data.kind = 'chat', 'pretokenized' or 'tokens'",
        ),
    ],
)
def test_a_token_budget_that_cannot_hold_is_refused_in_one_line(tmp_path, chat_inputs, overrides, message):
    tokenizer, chats, vocab = chat_inputs
    hf = _hf_llama(tmp_path / "hf", -(-vocab // 8) * 8, tie=False)
    proc = sft(tmp_path / "run", hf, tokenizer, chats, 1, *overrides, check=False)
    assert proc.returncode == 2
    err = proc.stderr.strip()
    assert message in err and len(err.splitlines()) == 1, err
