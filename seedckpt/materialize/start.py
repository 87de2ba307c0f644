"""Where a run starts: the checkpoint it loads from, opened once, and the checks a resume must pass.

The order of preference is fixed: the newest ``checkpoint.folder/step-N`` (resume; one that is not
complete stops the run with the fallback named), else
``finetune.pretrained`` for SFT / OSFT, else ``checkpoint.seed_checkpoint`` (which must exist -- a run
never silently starts from random), or, with ``checkpoint.init_from = "direct"``, each rank's own
per-tensor init from ``training.seed`` (bitwise the seed file that seed would make).

The chosen checkpoint is opened here, once: its ``.metadata``, checksums and data-file lengths are
checked before any process group exists (a damaged checkpoint is one line, not one per rank), and
the same ``OpenedCheckpoint`` object is handed to the stage builder and the train-state load, so a
resume reads and validates ``step-N``'s metadata once instead of three times.
"""

from __future__ import annotations

import dataclasses
import zlib
from dataclasses import dataclass
from pathlib import Path

from models.registry import family_of
from seedckpt.checkpoint import DcpCheckpoint, OpenedCheckpoint, step_dirs
from seedckpt.checkpoint.fingerprint import weights_fingerprint
from seedckpt.checkpoint.manifest import MANIFEST_NAME, read_manifest
from seedckpt.checkpoint.untrusted import MAX_JSON_BYTES, read_bounded
from seedckpt.config.job_config import JobConfig
from seedckpt.finetune.osft import manifest_osft
from seedckpt.finetune.pretrained import osft_spec
from seedckpt.materialize.init_recipe import RECIPE_VERSION
from seedckpt.materialize.model_checkpoint import codec_for, open_model_checkpoint
from seedckpt.utils.errors import SeedckptError


@dataclass(frozen=True)
class Start:
    checkpoint: OpenedCheckpoint | None  # None: initialize directly from training.seed
    step: int  # 0 when starting from the seed or the pretrained weights
    pretrained: bool = False  # fine-tuning's first start: the vocabulary may grow
    notes: tuple[str, ...] = ()  # lines for the run log about this start (``check_same_job``)

    @property
    def path(self) -> Path | None:
        return self.checkpoint.path if self.checkpoint is not None else None


def open_start(cfg: JobConfig, args, path: str | Path, step: int = 0, pretrained: bool = False) -> Start:
    """``path`` opened the way the stage builder loads it: checked against the run's model ``args``
    unless fine-tuning may grow the vocabulary (then only against what the checkpoint records), and
    with ``checkpoint.verify_checksums`` deciding whether the bytes read are checked."""
    checkpoint = open_model_checkpoint(
        path, None if pretrained else args, complete=False, verify=cfg.checkpoint.verify_checksums, model=cfg.model.name
    )
    return Start(checkpoint, step, pretrained)


def find_start(cfg: JobConfig, args, pretrained: OpenedCheckpoint | None = None) -> Start:
    """Where a run of ``cfg`` whose model is ``args`` starts (``resolve`` calls it once).
    ``pretrained``: fine-tuning's checkpoint, already opened by ``resolve`` (not opened again)."""
    steps = step_dirs(cfg.checkpoint.folder)
    if steps:
        chosen = resume_step(cfg, steps)
        try:  # the manifest, .metadata, its checksum and every data file's length
            start = open_start(cfg, args, require_manifest(steps[chosen]), chosen)
        except SeedckptError as e:
            raise SeedckptError(f"cannot resume: {e}; {fallback_hint(steps, chosen)}") from None
        notes = check_same_job(cfg, start, args)  # another job's steps: named before any advice to continue them
        check_within_steps(cfg, start)
        return dataclasses.replace(start, notes=notes)
    if cfg.finetune.mode != "none":
        if pretrained is not None:
            return Start(pretrained, 0, True)
        return open_start(cfg, args, cfg.finetune.pretrained, pretrained=True)
    if cfg.checkpoint.initial_load_path:
        return initial_start(cfg, args)
    if cfg.checkpoint.init_from == "direct":
        check_direct_init_matches_seed(cfg)
        return Start(None, 0)
    seed = cfg.checkpoint.seed_checkpoint
    if not seed:
        raise SeedckptError(
            "no checkpoint to start from: set checkpoint.seed_checkpoint (create it with "
            "`python create_seed_checkpoint.py --config CONFIG`)"
        )
    if not Path(seed).is_dir():
        raise SeedckptError(
            f"checkpoint.seed_checkpoint {seed} does not exist; create it with "
            f"`python create_seed_checkpoint.py --config CONFIG --output {seed}`"
        )
    return open_start(cfg, args, seed)  # damaged or incomplete: one line now, not one per rank later


def resume_step(cfg: JobConfig, steps: dict[int, Path]) -> int:
    """The step a run resumes: ``checkpoint.load_step``, or the newest in the folder."""
    load_step = cfg.checkpoint.load_step
    if load_step != -1 and load_step not in steps:
        raise SeedckptError(
            f"checkpoint.load_step = {load_step}: {cfg.checkpoint.folder} holds no step-{load_step} (it holds "
            f"{', '.join(p.name for _, p in sorted(steps.items()))}); choose one of those, or -1 for the newest"
        )
    return max(steps) if load_step == -1 else load_step


def check_within_steps(cfg: JobConfig, start: Start) -> None:
    """A resumed step beyond ``training.steps`` (of this job: ``check_same_job`` has passed) means the
    run was given fewer steps than it already trained."""
    if start.step > cfg.training.steps:
        raise SeedckptError(
            f"{start.path} is beyond training.steps = {cfg.training.steps}; raise "
            "training.steps to continue this run, or start a new checkpoint.folder"
        )


def initial_start(cfg: JobConfig, args) -> Start:
    """``checkpoint.initial_load_path`` as a new run's start: its weights, like a seed's; or, with
    ``initial_load_model_only = false``, a ``step-N``'s whole train state, continued from step N."""
    path = Path(cfg.checkpoint.initial_load_path)
    if cfg.checkpoint.initial_load_model_only:
        return open_start(cfg, args, path)
    manifest = read_manifest(path) if path.is_dir() else None
    step = (manifest or {}).get("step")
    if (manifest or {}).get("kind") != "train" or not isinstance(step, int) or step < 1:
        raise SeedckptError(
            f"checkpoint.initial_load_path = {path} is not a step-N written by train.py, so it has no train "
            "state to continue; set checkpoint.initial_load_model_only = true to start from its weights"
        )
    if step > cfg.training.steps:
        raise SeedckptError(f"{path} is at step {step}, beyond training.steps = {cfg.training.steps}; raise it")
    return open_start(cfg, args, path, step)


def check_same_job(cfg: JobConfig, start: Start, args=None) -> tuple[str, ...]:
    """A ``step-N`` in ``checkpoint.folder`` is resumed only by the job that wrote it: the same model
    family, fine-tuning mode and OSFT settings, the same start (a fine-tune's pretrained source, a
    pretraining run's seed: the same weights, by ``weights_fingerprint``) and, given this run's model
    ``args``, the same tensors. Another job's steps would be resumed as this one's weights -- or
    reported as nothing to train, with advice to continue them. Returns notes for the run log (a
    step-N that could identify its source by its config only)."""
    manifest = start.checkpoint.manifest or {}
    saved = manifest.get("finetune")
    if not isinstance(saved, dict):
        return ()  # written before jobs were recorded
    other = _other_job(cfg, manifest, saved) or _other_model(cfg, start, args)
    if other is not None:
        raise another_job(cfg, start, other)
    if cfg.finetune.mode == "none":
        return ()
    return _unchecked_weights_note(saved, start, cfg.finetune.pretrained)


def _other_job(cfg: JobConfig, manifest: dict, saved: dict) -> str | None:
    """How the job that wrote ``manifest`` (its job record ``saved``) differs from ``cfg``'s, in words;
    None where nothing recorded tells them apart."""
    ft = cfg.finetune
    family = (manifest.get("model") or {}).get("name")
    if ft.mode == "none" and family not in (None, cfg.model.name):
        return f"model.name {family!r}, this run's {cfg.model.name!r}"
    if saved.get("mode", "none") != ft.mode:
        return f"finetune.mode {saved.get('mode')!r}, this run's {ft.mode!r}"
    if manifest_osft(manifest) != osft_spec(cfg):
        return f"{_describe_osft(manifest_osft(manifest))}, this run's {_describe_osft(osft_spec(cfg))}"
    if ft.mode == "none":
        return _other_start(manifest.get(START_KEY), start_identity(cfg))
    if not _same_source(saved, ft.pretrained):
        return f"fine-tuned from {saved.get('pretrained')}, this run from {ft.pretrained}, whose weights differ"
    return None


def _other_model(cfg: JobConfig, start: Start, args) -> str | None:
    """The shape fields in which this run's model (``args``) has other tensors than the step holds."""
    recorded = start.checkpoint.recorded if args is not None else None
    if recorded is None:
        return None
    family = family_of(args)
    if codec_for(family.name).layout(args, osft_spec(cfg)).shapes == recorded.shapes:
        return None
    fields = [f for f in family.shape_fields if getattr(recorded.args, f) != getattr(args, f)]
    if not fields:
        return "another model, with other tensors than this run's"
    return "another model: " + "; ".join(
        f"{f} {getattr(recorded.args, f)!r}, this run's {getattr(args, f)!r}" for f in fields
    )


def another_job(cfg: JobConfig, start: Start, other: str) -> SeedckptError:
    """The refusal of a folder holding another job's ``start`` (``other``: how that job differs)."""
    return SeedckptError(
        f"checkpoint.folder = {cfg.checkpoint.folder} holds {start.path.name} of another job ({other}); give "
        "this run a checkpoint.folder of its own (or move those steps away to start this job there)"
    )


# Where a step-N of a pretraining run records what its step 0 held (``start_identity``).
START_KEY = "started_from"
DIRECT = "direct:"  # the identity of a direct init: the seed and recipe it drew with


def start_identity(cfg: JobConfig) -> dict | None:
    """What a pretraining run's step 0 holds, as its ``step-N`` records it: ``{"from": words,
    "weights": identity}`` -- the checkpoint it loads (``initial_load_path`` or the seed) by its weights'
    fingerprint, or a direct init by its seed and recipe. None for a fine-tune (its pretrained source
    is recorded instead) or a start that is not there to fingerprint (a seed deleted since)."""
    ckpt = cfg.checkpoint
    if cfg.finetune.mode != "none":
        return None
    path = ckpt.initial_load_path or (ckpt.seed_checkpoint if ckpt.init_from != "direct" else "")
    if not path:
        seed = cfg.training.seed
        return {"from": f"a direct init from training.seed {seed}", "weights": f"{DIRECT}{seed}:{RECIPE_VERSION}"}
    weights = weights_fingerprint(path) if Path(path).exists() else None
    return {"from": str(path), "weights": weights} if weights is not None else None


def _other_start(saved, now: dict | None) -> str | None:
    """How the recorded start ``saved`` differs from this run's (``start_identity``); None when they
    are the same or cannot be compared: one unknown, or a seed file against a direct init (which the
    seed of the same training.seed holds bitwise)."""
    if not isinstance(saved, dict) or now is None or not isinstance(saved.get("weights"), str):
        return None
    if saved["weights"].startswith(DIRECT) != now["weights"].startswith(DIRECT) or saved["weights"] == now["weights"]:
        return None
    return f"started from {saved.get('from')}, this run from {now['from']}, whose weights differ"


# Where a step-N records its pretrained source's identity: the weights' fingerprint; before that, the
# CRC32 of the source's manifest or ``config.json`` (which two models of one architecture share).
WEIGHTS_KEY = "pretrained_weights"
CONFIG_CRC_KEY = "pretrained_fingerprint"


def _same_source(saved: dict, pretrained: str) -> bool:
    if saved.get(WEIGHTS_KEY) is not None:
        return saved[WEIGHTS_KEY] == weights_fingerprint(pretrained)
    if saved.get(CONFIG_CRC_KEY) is not None:
        return saved[CONFIG_CRC_KEY] == config_crc(pretrained)
    return Path(str(saved.get("pretrained"))).resolve() == Path(pretrained).resolve()


def config_crc(path: str | Path) -> str | None:
    """The identity an older step-N records for its source ``path``: the CRC32 of how the source
    describes itself (our manifest, or a Hugging Face ``config.json``); None for a file."""
    for name in (MANIFEST_NAME, "config.json"):
        file = Path(path) / name
        if file.is_file():
            return f"{zlib.crc32(read_bounded(file, MAX_JSON_BYTES)):08x}"
    return None


def _unchecked_weights_note(saved: dict, start: Start, pretrained: str) -> tuple[str, ...]:
    """A step-N that records only its source's config CRC is resumed when that matches -- refusing it
    would strand every run interrupted across the upgrade -- and the log says what was not checked.
    The CRC of our manifest covers the weights' checksums: only a ``config.json`` leaves them out."""
    if saved.get(WEIGHTS_KEY) is not None or saved.get(CONFIG_CRC_KEY) is None:
        return ()
    if (Path(pretrained) / MANIFEST_NAME).is_file():
        return ()
    return (
        f"{start.path} records its pretrained source {saved.get('pretrained')} by its configuration only "
        "(written by an older seedckpt), so the weights could not be compared: resuming it as this job's. "
        "If finetune.pretrained now holds another model of the same architecture, stop and give this run "
        "a checkpoint.folder of its own",
    )


def require_manifest(step: Path) -> Path:
    """``step`` if it holds the manifest every ``step-N`` is written with (a DCP directory without
    one would open as a foreign checkpoint and lose the run's step, data position and settings)."""
    if not (step / MANIFEST_NAME).is_file():
        raise SeedckptError(
            f"{step} has no {MANIFEST_NAME}, which every step-N is written with: it is not a "
            "complete checkpoint (copied in part, or filtered by the copy)"
        )
    return step


def fallback_hint(steps: dict[int, Path], broken: int) -> str:
    """What to do about a damaged ``step-N``: which earlier checkpoint would resume instead. A run
    never falls back by itself -- that would silently throw work away on a storage fault."""
    for step in sorted((s for s in steps if s < broken), reverse=True):
        try:
            DcpCheckpoint(require_manifest(steps[step]))
        except SeedckptError:
            continue
        return (
            f"the newest earlier checkpoint that opens is {steps[step]} (`seedckpt verify {steps[step]}` checks "
            f"every byte and names any NaN or Inf): move {steps[broken]} out of the folder to resume from step {step}"
        )
    return "no earlier checkpoint in the folder opens: start again from the seed in a new checkpoint.folder"


# The sections whose values a resume may change: each applies from the next step, and is logged.
RESUMABLE_SECTIONS = ("training", "optimizer", "lr_scheduler")


def changed_settings(cfg: JobConfig, start: Start) -> list[str]:
    """The ``[training]``, ``[optimizer]`` and ``[lr_scheduler]`` values that differ from those
    ``start``'s checkpoint was trained with (a checkpoint of an older version records only
    ``[training]``: the rest is not compared)."""
    manifest = (start.checkpoint.manifest or {}) if start.step else {}
    changes = []
    for section in RESUMABLE_SECTIONS:
        saved = manifest.get(section)
        if not isinstance(saved, dict):
            continue
        now = dataclasses.asdict(getattr(cfg, section))
        changes += [f"{section}.{k} {saved[k]!r} -> {v!r}" for k, v in now.items() if k in saved and saved[k] != v]
    return changes


def check_resume_matches_osft(cfg: JobConfig, start: Start) -> None:
    """A resumed run must train what its checkpoint holds: the same OSFT settings (the factors'
    shapes follow from them), or dense weights for a run without OSFT."""
    if not start.step:
        return
    saved = manifest_osft(start.checkpoint.manifest)
    wanted = osft_spec(cfg)
    if saved != wanted:
        raise another_job(cfg, start, f"{_describe_osft(saved)}, this run's {_describe_osft(wanted)}")


def _describe_osft(spec) -> str:
    return f"osft (ratio {spec.ratio}, targets {list(spec.patterns)})" if spec is not None else "no osft"


def check_direct_init_matches_seed(cfg: JobConfig) -> None:
    """Direct init promises the values of the seed made with ``training.seed``; when a configured
    ``seed_checkpoint`` exists and was made otherwise (another seed, an older init recipe), refuse
    rather than silently start from different weights."""
    path = Path(cfg.checkpoint.seed_checkpoint) if cfg.checkpoint.seed_checkpoint else None
    manifest = read_manifest(path) if path is not None and path.is_dir() else None
    if manifest is None:
        return
    recipe = (manifest.get("init") or {}).get("recipe")
    made = (manifest.get("seed"), recipe)
    if made != (cfg.training.seed, RECIPE_VERSION):
        raise SeedckptError(
            f"checkpoint.init_from = direct would draw seed {cfg.training.seed} with {RECIPE_VERSION}, but "
            f"checkpoint.seed_checkpoint {path} was made with seed {made[0]} and {recipe or 'an unknown recipe'}: "
            "load it (checkpoint.init_from = seed_checkpoint), or unset checkpoint.seed_checkpoint"
        )
