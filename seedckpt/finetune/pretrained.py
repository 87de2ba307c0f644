"""Fine-tuning set-up: the model's shape comes from the pretrained checkpoint, its vocabulary from
the tokenizer.

SFT and OSFT start from ``finetune.pretrained`` -- a DCP checkpoint of ours or a Hugging Face
directory of the family -- through the same ``build_stages`` path as pretraining: every rank reads only its
stage's tensors (and its rows under FSDP), nobody holds the whole model. This module only decides
*which* model that is, before any process group or allocation:

* The model's family and args are read from the checkpoint (``seedckpt.json`` or ``config.json``);
  ``[model]`` takes that family's keys. One that would change the checkpoint's tensors (``dim``, the
  experts' count ...), or another ``name``, is an error naming both values -- never silently
  ignored; the others apply to its args, each named in the run log (``with_model_keys``).
* The tokenizer: the one the pretrained directory carries, unless ``data.tokenizer`` names another
  (``job_config.with_pretrained_tokenizer``). Another one must keep every id of the directory's own
  -- it may only add tokens after them -- or the model would read tokens it was never trained on:
  one that moves them is refused, naming both. Which tokenizer the run uses, and why, is one line
  of the run log.
* Vocabulary alignment (Mini Trainer's rule): a tokenizer with more tokens than the checkpoint's
  vocabulary grows the embedding and the output projection to the next multiple of 8 (the new
  rows start as the mean of the old ones, see ``stages``); the vocabulary never shrinks.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from seedckpt.checkpoint import OpenedCheckpoint
from seedckpt.config.job_config import JobConfig
from seedckpt.data.tokenizer import load_tokenizer, moved_tokens, own_tokenizer
from seedckpt.finetune.osft import OSFTSettings, describe_targets, manifest_osft, pattern_matches, target_fqns
from seedckpt.materialize.model_checkpoint import codec_for, open_model_checkpoint, refuse_float64
from seedckpt.utils.errors import SeedckptError

VOCAB_MULTIPLE = 8


def aligned_vocab_size(checkpoint_vocab: int, tokenizer_vocab: int) -> int:
    """The checkpoint's vocabulary, grown to a multiple of 8 when the tokenizer needs more rows."""
    if tokenizer_vocab <= checkpoint_vocab:
        return checkpoint_vocab
    return -(-tokenizer_vocab // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


def open_pretrained(path: str, family: str | None = None, verify: bool = True) -> OpenedCheckpoint:
    """The pretrained checkpoint at ``path``, a ``family`` model (None: the one the checkpoint records
    or its ``config.json`` names), opened once for the whole start: its args shape the run, and the
    stage builder loads from the same object. ``verify``: check the bytes read against its checksums."""
    if not Path(path).exists():
        raise SeedckptError(
            f"finetune.pretrained {path} does not exist; give a DCP checkpoint directory or a "
            "Hugging Face directory (config.json + *.safetensors)"
        )
    checkpoint = open_model_checkpoint(path, model=family, verify=verify)
    refuse_float64(
        checkpoint, f"cast it once: `seedckpt convert {path} OUT --to dcp --dtype float32`, then fine-tune from OUT"
    )
    if manifest_osft(checkpoint.manifest) is not None:
        raise SeedckptError(
            f"finetune.pretrained {path} holds an OSFT run's SVD factors, not dense weights; "
            f"for the next task export it first: seedckpt convert {path} DENSE_DIR --to dcp --dense "
            "(to continue that run instead, set checkpoint.folder to its folder and finetune.pretrained to what "
            "it started from)"
        )
    checkpoint.require_args()
    return checkpoint


def with_model_keys(cfg: JobConfig, args, where: str) -> tuple[object, str | None]:
    """The pretrained checkpoint's ``args`` with the ``[model]`` keys the user set, and a line for the
    run log naming each applied with the checkpoint's value. The checkpoint fixes the model's tensors:
    a key that would change them (dim, n_layers, the experts' count and width ...) is refused in one
    line, unless it repeats the checkpoint's value. The others apply -- balancing (load_balance
    between two kinds without a bias tensor, aux_loss_coef, bias_update_rate), and settings that change
    the math the weights were trained with (norm_topk_prob, top_k, rope_theta, norm_eps ...): the log
    line says so, since a model computed otherwise than trained may need the fine-tune to adapt."""
    check_flavor(cfg, args)
    family = cfg.model_family()
    codec, base = codec_for(family.name), args.to_dict()
    fixed, applied = [], {}
    for key, value in cfg.model.overrides.items():
        try:  # the value as the args hold it (a rope_scaling table becomes the family's dataclass)
            single = family.args.from_dict({**base, key: value})
        except (TypeError, ValueError, ZeroDivisionError) as e:
            if key not in family.shape_fields:
                raise _unfit(cfg.model.overrides, where, e) from None
            single = None
        if single is not None and getattr(single, key) == getattr(args, key):
            continue
        # a shape field may keep every tensor (load_balance "aux_loss" -> "none": neither has a bias)
        if key in family.shape_fields and (single is None or not _keeps_tensors(family, codec, single, args)):
            fixed.append(f"model.{key} = {value!r} (the checkpoint: {getattr(args, key)!r})")
        else:
            applied[key] = value
    if fixed:
        free = [f.name for f in dataclasses.fields(family.args) if f.name not in family.shape_fields]
        raise SeedckptError(
            f"[model] would change the tensors of finetune.pretrained {where}, which fixes them: {'; '.join(fixed)}; "
            f"remove {'it' if len(fixed) == 1 else 'them'} (the keys that keep its tensors apply: {', '.join(free)})"
        )
    if not applied:
        return args, None
    try:
        tuned = family.args.from_dict({**base, **applied})
    except (TypeError, ValueError, ZeroDivisionError) as e:
        raise _unfit(applied, where, e) from None
    changes = "; ".join(f"{key} = {getattr(tuned, key)!r} ({getattr(args, key)!r})" for key in applied)
    return tuned, (
        f"[model] keys applied to finetune.pretrained's model, whose weights were trained with the values in "
        f"brackets: {changes}"
    )


def _keeps_tensors(family, codec, tuned, args) -> bool:
    """Whether ``tuned`` holds the checkpoint's tensors as ``args`` does: the same shapes, and no tie
    the checkpoint keeps apart (tied, its trained output projection would be replaced by the
    embedding: another model, refused here rather than by the trainer's check after start-up)."""
    new_ties = family.tied_weights(tuned).items() - family.tied_weights(args).items()
    return codec.layout(tuned).shapes == codec.layout(args).shapes and not new_ties


def _unfit(keys, where: str, error: Exception) -> SeedckptError:
    return SeedckptError(
        f"[model] keys {sorted(keys)} do not fit finetune.pretrained {where} ({error}); remove or change them"
    )


def check_flavor(cfg: JobConfig, args) -> None:
    """A ``model.flavor`` the user set must have the pretrained checkpoint's shapes (as the ``[model]``
    keys shape it: an 8B flavor with n_layers = 2 is fine)."""
    model, family = cfg.model, cfg.model_family()
    if "flavor" not in model.given:
        return
    flavor = cfg.model_args()
    conflicts = [
        f"model.flavor = {model.flavor!r} has {f} = {getattr(flavor, f)!r}, the checkpoint {getattr(args, f)!r}"
        for f in family.shape_fields
        if f not in model.overrides and getattr(flavor, f) != getattr(args, f)  # overrides: ``with_model_keys``
    ]
    if conflicts:
        raise SeedckptError(
            f"[model] contradicts finetune.pretrained {cfg.finetune.pretrained}: {'; '.join(conflicts)}. The model "
            "comes from the pretrained checkpoint: remove model.flavor or make it match"
        )


def osft_spec(cfg: JobConfig) -> OSFTSettings | None:
    """The run's OSFT settings, with the default targets spelled out (checkpoints record them, so a
    later change of the defaults cannot change what an existing checkpoint holds)."""
    ft = cfg.finetune
    if ft.mode != "osft":
        return None
    return OSFTSettings(ft.osft_unfreeze_rank_ratio, tuple(ft.osft_target_patterns) or cfg.model_family().osft_targets)


def check_osft_settings(cfg: JobConfig, args) -> str:
    """The ratio is a fraction and every pattern given names some of the model's linear layers (one
    that matches nothing is a typo: training would silently leave that layer dense). The family's
    default targets are those of them the model has (a model whose every layer is a mixture of
    experts has no dense feed-forward). Returns the log line that lists the targets."""
    ft, family = cfg.finetune, cfg.model_family()
    patterns = ft.osft_target_patterns
    examples = ", ".join(f'"{p}"' for p in family.osft_targets[:2])
    if not isinstance(patterns, list) or not all(isinstance(p, str) and p for p in patterns):
        raise SeedckptError(
            f"finetune.osft_target_patterns = {patterns!r}: give a list of names such as "
            f"[{examples}] (empty: the default targets)"
        )
    given = bool(patterns)
    with torch.device("meta"):
        model = family.model(args)
    matches = pattern_matches(model, patterns or list(family.osft_targets))
    patterns = [p for p, fqns in matches.items() if fqns or given]
    unmatched = [p for p, fqns in matches.items() if not fqns]
    if unmatched and (given or not patterns):
        raise SeedckptError(
            f"finetune.osft_target_patterns: {', '.join(map(repr, unmatched))} "
            f"match{'es' * (len(unmatched) == 1)} no linear layer inside the model's blocks; fix or "
            f"remove {'it' if len(unmatched) == 1 else 'them'} (names end like "
            f"{', '.join(family.osft_targets[:3])} ...)"
        )
    return describe_targets(model, target_fqns(model, patterns), ft.osft_unfreeze_rank_ratio)  # checks the ratio


def finetune_model(cfg: JobConfig) -> tuple[object, tuple[str, ...], OpenedCheckpoint] | None:
    """Validate ``[finetune]``; the pretrained model's args, its vocabulary grown to fit
    ``data.tokenizer``, lines for the run log and the opened pretrained checkpoint (None for
    pretraining). Reads only metadata, so it runs before any process group: a bad set-up fails at
    once, with one line."""
    ft = cfg.finetune
    if ft.mode == "none":
        if ft.pretrained:
            raise SeedckptError(
                "finetune.pretrained is set but finetune.mode = 'none'; set finetune.mode = 'sft' or 'osft'"
            )
        return None
    if not ft.pretrained:
        raise SeedckptError(
            f"finetune.mode = {ft.mode!r} needs finetune.pretrained (a DCP checkpoint or an HF "
            "directory), e.g. --finetune.pretrained path/to/Llama-3.2-1B"
        )
    pretrained = open_pretrained(ft.pretrained, cfg.model.name, cfg.checkpoint.verify_checksums)
    args, applied = with_model_keys(cfg, pretrained.require_args(), ft.pretrained)
    targets = check_osft_settings(cfg, args) if ft.mode == "osft" else None
    vocab, tokenizer = f"vocabulary {args.vocab_size}", None
    if cfg.data.tokenizer:
        tokenizer_vocab, tokenizer = check_tokenizer(cfg.data.tokenizer, ft.pretrained)
        grown = aligned_vocab_size(args.vocab_size, tokenizer_vocab)
        if grown != args.vocab_size:
            vocab = (
                f"vocabulary grown from {args.vocab_size} to {grown} rows for the tokenizer's {tokenizer_vocab} "
                "tokens (new rows = mean of the old)"
            )
        args = dataclasses.replace(args, vocab_size=grown)
    start = (
        f"{ft.mode} from {ft.pretrained}: dim {args.dim}, {args.n_layers} layers, {vocab}, "
        f"{'tied' if args.tie_word_embeddings else 'untied'} embeddings"
    )
    return args, tuple(line for line in (start, applied, tokenizer, targets) if line), pretrained


def check_tokenizer(path: str, pretrained: str) -> tuple[int, str]:
    """The size of tokenizer ``path`` (``data.tokenizer``) and the run log's line saying which
    tokenizer this is and why. A tokenizer other than the one the pretrained directory carries
    must keep that one's ids (``moved_tokens``); one that moves them is refused, naming both. A
    directory that carries none leaves nothing to check against: the line says so."""
    tokenizer = load_tokenizer(path)
    own = own_tokenizer(pretrained)
    if own is None:
        return len(tokenizer), (
            f"tokenizer: data.tokenizer {path} ({len(tokenizer)} tokens); finetune.pretrained {pretrained} "
            "carries no tokenizer, so nothing checks that these ids are the ones its model was trained with"
        )
    if own.resolve() == Path(path).resolve():
        return len(tokenizer), f"tokenizer: finetune.pretrained's own, {own} ({len(tokenizer)} tokens)"
    base = load_tokenizer(own)
    moved = moved_tokens(tokenizer, base)
    if moved:
        token, was, now = moved[0]
        raise SeedckptError(
            f"data.tokenizer {path} ({len(tokenizer)} tokens) is not finetune.pretrained's own tokenizer, "
            f"{own} ({len(base)} tokens): it moves {len(moved)} of the model's token ids (e.g. "
            f"{token!r} is {was} in the model's, {'absent' if now is None else now} in data.tokenizer's), so "
            f"the model would read tokens it was not trained on; set --data.tokenizer {own} (the model's own), "
            "or give a tokenizer that keeps its ids and adds tokens after them"
        )
    return len(tokenizer), (
        f"tokenizer: data.tokenizer {path} ({len(tokenizer)} tokens), which keeps every id of finetune.pretrained's "
        f"own {own} ({len(base)} tokens)"
    )
