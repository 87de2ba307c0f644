"""Read rate of quantized Hugging Face directories (FP8 blocks, MXFP4 and INT4 experts) against the
same model stored in bf16, measured in the same run.

Run from the repository root:

    python benchmarks/quantized_read.py                  # the shapes below, ~1.5 GB of directories
    python benchmarks/quantized_read.py --small          # debug shapes: a check of the harness

Per format, one model: FP8, Llama 3 1B's layers (dim 2048, FFN 8192) x 4 with a 32k vocabulary, so
the quantized layers hold most of the bytes; MXFP4, gpt-oss's block (the ``debug`` flavor widened to
dim 1024, 8 experts 1024 wide, 4 layers); INT4, Kimi K2's (its ``debug`` flavor widened the same
way, 4 layers of which 3 hold experts). Its bf16 seed is converted to a Hugging Face directory (the
baseline), and a copy is quantized by ``tests/quantizers.py`` (FP8: every 2-D weight of the layers,
as DeepSeek-V3 releases; MXFP4 and INT4: the experts, as gpt-oss and Kimi-K2-Thinking do). Each
directory is read by ``seedckpt.load_model`` (a float32 model, one process) once to warm the page
cache, then ``--repeats`` times; the median is kept, so the figure is the reader's (reading,
dequantizing, copying), not the disk's.

JSON lines: one per directory (``format``, ``source`` bf16 or quantized, ``stored_bytes``,
``parameters``, ``load_s``, ``gb_per_s`` of stored bytes, ``mparams_per_s``), then one ``comparison``
per format: the quantized read's time and stored bytes over the bf16 read's.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import output_dir, parser  # noqa: E402

MODELS = {  # format: (the config's model overrides, the full form; the small form)
    "fp8": (
        ["--model.name", "llama3", "--model.flavor", "1B", "--model.n_layers", "4", "--model.vocab_size", "32000"],
        ["--model.name", "llama3", "--model.flavor", "debug", "--model.dim", "256", "--model.n_layers", "2"],
    ),
    "mxfp4": (
        [
            *["--model.name", "gpt_oss", "--model.flavor", "debug", "--model.dim", "1024"],
            *["--model.moe_ffn_dim", "1024", "--model.n_experts", "8"],
        ],
        ["--model.name", "gpt_oss", "--model.flavor", "debug"],
    ),
    "int4": (
        [
            *["--model.name", "kimi_k2", "--model.flavor", "debug", "--model.dim", "1024"],
            *["--model.moe_ffn_dim", "1024", "--model.n_experts", "8"],
        ],
        ["--model.name", "kimi_k2", "--model.flavor", "debug"],
    ),
}
EXPERT = re.compile(r"model\.layers\.\d+\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight")  # one per expert


def chosen(method: str):
    """Which tensors a release quantizes: FP8, the layers' 2-D weights; MXFP4 and INT4, the experts."""
    if method == "fp8":
        return lambda name, t: name.startswith("model.layers.") and name.endswith(".weight") and t.dim() == 2
    if method == "int4":
        return lambda name, t: EXPERT.fullmatch(name) is not None
    return lambda name, t: name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))


def directories(method: str, overrides: list[str], work: Path) -> dict[str, Path]:
    """The model's bf16 HF directory and its quantized copy."""
    from seedckpt.cli.convert import convert
    from seedckpt.config.job_config import load_config
    from seedckpt.materialize.seed import create_seed_checkpoint
    from tests.quantizers import quantize_directory

    seed = create_seed_checkpoint(load_config(None, overrides), work / "seed", seed=0, dtype="bfloat16", progress=False)
    bf16 = convert(seed, work / "bf16", "hf", progress=False)
    quantize_directory(bf16, work / method, method, chosen(method))
    return {"bf16": bf16, method: work / method}


def read_rate(path: Path, repeats: int) -> dict:
    import torch

    from seedckpt import load_model

    model = load_model(path)  # warms the page cache
    parameters = sum(t.numel() for t in model.state_dict().values())
    del model
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        model = load_model(path)
        times.append(time.perf_counter() - start)
        del model
    stored = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    load_s = statistics.median(times)
    return {
        "stored_bytes": stored,
        "parameters": parameters,
        "load_s": load_s,
        "gb_per_s": stored / load_s / 1e9,
        "mparams_per_s": parameters / load_s / 1e6,
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
    }


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--formats", default="fp8,mxfp4,int4", help="comma-separated: fp8, mxfp4, int4 (default all)")
    p.add_argument("--repeats", type=int, default=3, help="timed reads per directory (default 3)")
    p.add_argument("--small", action="store_true", help="debug shapes: a quick check of the harness")
    opts = p.parse_args()
    for method in opts.formats.split(","):
        overrides = MODELS[method][1 if opts.small else 0]
        with output_dir(opts.out_dir and str(Path(opts.out_dir) / method), f"seedckpt-{method}-read-") as work:
            rates = {}
            for source, path in directories(method, overrides, work).items():
                rates[source] = read_rate(path, opts.repeats)
                print(json.dumps({"format": method, "source": source, **rates[source]}), flush=True)
            base, ours = rates["bf16"], rates[method]
            comparison = {
                "comparison": f"{method}_vs_bf16",
                "load_s_ratio": ours["load_s"] / base["load_s"],
                "stored_bytes_ratio": ours["stored_bytes"] / base["stored_bytes"],
                "mparams_per_s": [ours["mparams_per_s"], base["mparams_per_s"]],
            }
            print(json.dumps(comparison), flush=True)


if __name__ == "__main__":
    main()
