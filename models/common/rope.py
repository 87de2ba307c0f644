"""Rotary position embeddings (RoPE) and the ways checkpoints stretch them past their training context.

A head's ``dim`` rotary channels form ``dim / 2`` pairs; pair ``i`` turns by ``pos * freq[i]`` with
``freq[i] = theta^(-2i / dim)``. Pairs are interleaved, ``(x0, x1), (x2, x3), ...`` (Meta's
convention); Hugging Face rotates the two halves of a head against each other instead, so its
checkpoints' q/k rows are permuted on conversion (``models.common.hf_names``).

``RopeScaling`` describes a stretch as Hugging Face's ``rope_parameters`` (``rope_scaling`` before
transformers 5) names it; ``models.common.hf_config.rope_scaling`` reads one from a ``config.json``
with every field checked, and ``RopeScaling.to_config`` writes it back. The kinds:

``linear``  every frequency divided by ``factor`` (positions interpolated).
``llama3``  Llama 3.1's: low frequencies (wavelength > original / ``low_freq_factor``) divided by
            ``factor``, high ones (wavelength < original / ``high_freq_factor``) kept, a smooth
            blend between.
``yarn``    YaRN: pairs that turn fewer than ``beta_slow`` times over the original context are
            interpolated (divided by ``factor``), pairs turning more than ``beta_fast`` times are
            kept, with a linear ramp between (its ends rounded outward unless ``truncate`` is
            false); and every attention logit grows by ``attention_factor^2``. That factor, when a
            config does not give it, is ``0.1 ln(factor) + 1``, or with both ``mscale`` and
            ``mscale_all_dim`` the ratio ``yarn_mscale(factor, mscale) / yarn_mscale(factor,
            mscale_all_dim)`` (DeepSeek's; equal values make it 1).

``rope_frequencies(dim, theta, scaling)`` returns the per-pair frequencies and that attention
factor; ``rope_table(freqs, attention_factor, length)`` the complex table ``e^{i pos freq}`` times
the factor, which rotates q and k alike, so their product -- the logit -- carries the factor squared
(exactly what ``transformers`` computes by scaling its cos and sin). A model holds the table as a
non-persistent buffer: it is a function of the args, never a weight.

DeepSeek-V3's attention additionally multiplies its softmax scale by ``yarn_mscale(factor,
mscale_all_dim)^2`` (``softmax_scale_multiplier``); the shared decoder never does.

Partial RoPE (HF's ``partial_rotary_factor``: GLM-4.5 turns half of each head): a family whose args
have ``rotary_dim`` gets a table that wide, and ``apply_rotary_emb`` turns only a head's first
``rotary_dim`` channels -- interleaved pairs among them, the rest passed through as they are. HF's
classes turn halves of those first channels, so conversion permutes the rows within them only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

# The kinds of stretch computed here; transformers' others are refused when a config is read.
SCALING_TYPES = ("linear", "llama3", "yarn")


@dataclass(frozen=True)
class RopeScaling:
    """A RoPE stretch, with the fields of Hugging Face's ``rope_parameters`` (see the module doc).

    ``factor`` is the ratio of the new context to the original one; ``original_max_position_embeddings``
    the context the model was trained at (``llama3``, ``yarn``). The ``llama3`` and ``yarn`` fields are
    ignored by the other kinds. ``None`` for ``mscale``/``mscale_all_dim``/``attention_factor`` means
    what it means in ``transformers``: not given.
    """

    rope_type: Literal["linear", "llama3", "yarn"]
    factor: float
    original_max_position_embeddings: int | None = None
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn: turns over the original context above which a pair is kept
    beta_slow: float = 1.0  # yarn: turns below which a pair is interpolated
    mscale: float | None = None  # yarn
    mscale_all_dim: float | None = None  # yarn
    attention_factor: float | None = None  # yarn: None derives it from factor (and the mscales)
    truncate: bool = True  # yarn: round the ramp's ends to whole pairs

    def __post_init__(self):
        if self.rope_type not in SCALING_TYPES:
            raise ValueError(
                f"rope_scaling.rope_type = {self.rope_type!r}; this version computes {', '.join(SCALING_TYPES)}"
            )
        _check_positive("factor", self.factor)
        if self.rope_type != "linear":
            n = self.original_max_position_embeddings
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(
                    f"rope_scaling.original_max_position_embeddings = {n!r}; {self.rope_type} RoPE needs the "
                    "context the model was trained at, an integer >= 1"
                )
        for name in ("low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow"):
            _check_positive(name, getattr(self, name))
        for name in ("mscale", "mscale_all_dim", "attention_factor"):
            if getattr(self, name) is not None:
                _check_positive(name, getattr(self, name), allow_zero=True)
        if self.rope_type == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(
                f"rope_scaling.high_freq_factor = {self.high_freq_factor}; it must exceed "
                f"rope_scaling.low_freq_factor = {self.low_freq_factor}"
            )
        if not isinstance(self.truncate, bool):
            raise ValueError(f"rope_scaling.truncate = {self.truncate!r}; it must be true or false")

    def to_config(self, theta: float) -> dict:
        """This stretch as a ``config.json``'s ``rope_parameters`` (``rope_theta`` included)."""
        out = {"rope_type": self.rope_type, "rope_theta": theta, "factor": self.factor}
        if self.rope_type != "linear":
            out["original_max_position_embeddings"] = self.original_max_position_embeddings
        if self.rope_type == "llama3":
            out |= {"low_freq_factor": self.low_freq_factor, "high_freq_factor": self.high_freq_factor}
        if self.rope_type == "yarn":
            out |= {"beta_fast": self.beta_fast, "beta_slow": self.beta_slow, "truncate": self.truncate}
            for name in ("mscale", "mscale_all_dim", "attention_factor"):
                if getattr(self, name) is not None:
                    out[name] = getattr(self, name)
        return out


def _check_positive(name: str, value, allow_zero: bool = False) -> None:
    number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not number or value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"rope_scaling.{name} = {value!r}; it must be a finite number {'>=' if allow_zero else '>'} 0")


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context stretched ``factor`` times: ``0.1 mscale ln(factor) + 1``
    (1 when nothing is stretched)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def softmax_scale_multiplier(scaling: RopeScaling | None) -> float:
    """DeepSeek-V3's extra factor on its attention's softmax scale: ``yarn_mscale(factor,
    mscale_all_dim)^2`` when a stretch gives ``mscale_all_dim``, else 1."""
    if scaling is None or not scaling.mscale_all_dim:
        return 1.0
    return yarn_mscale(scaling.factor, scaling.mscale_all_dim) ** 2


def rope_frequencies(
    dim: int, theta: float, scaling: RopeScaling | None = None, device: torch.device | None = None
) -> tuple[torch.Tensor, float]:
    """``(freqs, attention_factor)``: the ``dim // 2`` float32 per-pair frequencies of a rotary width
    ``dim`` at base ``theta``, stretched by ``scaling``, and the factor the table carries (1 but for
    YaRN). Computed in float64, then rounded once."""
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, device=device, dtype=torch.float64) / dim))
    attention_factor = 1.0
    if scaling is None:
        pass
    elif scaling.rope_type == "linear":
        freqs = freqs / scaling.factor
    elif scaling.rope_type == "llama3":
        freqs = _llama3(freqs, scaling)
    else:
        freqs, attention_factor = _yarn(freqs, dim, theta, scaling)
    return freqs.float(), attention_factor


def _llama3(freqs: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    wavelen = 2 * math.pi / freqs
    original = s.original_max_position_embeddings
    smooth = (original / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    blended = (1 - smooth) * freqs / s.factor + smooth * freqs
    low, high = wavelen > original / s.low_freq_factor, wavelen < original / s.high_freq_factor
    return torch.where(low, freqs / s.factor, torch.where(high, freqs, blended))


def _yarn(freqs: torch.Tensor, dim: int, theta: float, s: RopeScaling) -> tuple[torch.Tensor, float]:
    def pair_turning(turns: float) -> float:
        # The (fractional) pair index whose rotation completes ``turns`` turns over the original context.
        return dim * math.log(s.original_max_position_embeddings / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = pair_turning(s.beta_fast), pair_turning(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a one-pair ramp would divide by zero
    index = torch.arange(dim // 2, device=freqs.device, dtype=torch.float64)
    interpolate = ((index - low) / (high - low)).clamp(0, 1)  # 0: kept as is, 1: divided by factor
    freqs = freqs / s.factor * interpolate + freqs * (1 - interpolate)
    if s.attention_factor is not None:
        return freqs, s.attention_factor
    if s.mscale and s.mscale_all_dim:
        return freqs, yarn_mscale(s.factor, s.mscale) / yarn_mscale(s.factor, s.mscale_all_dim)
    return freqs, yarn_mscale(s.factor)


def rope_table(
    freqs: torch.Tensor, attention_factor: float, length: int, device: torch.device | None = None
) -> torch.Tensor:
    """``(length, len(freqs))`` complex64: ``attention_factor * e^{i pos freq}`` for positions
    ``0..length-1``."""
    angles = torch.outer(torch.arange(length, device=device, dtype=torch.float32), freqs.to(device))
    return torch.polar(torch.full_like(angles, attention_factor), angles)


def precompute_freqs_cis(
    args, device: torch.device | None = None, length: int | None = None, theta: float | None = None
) -> torch.Tensor:
    """The shared decoder's table: ``args.head_dim`` rotary channels, ``args.rope_theta``,
    ``args.rope_scaling``, ``length`` positions (default ``args.max_seq_len``). ``theta``: a second
    table's own base, unstretched -- Gemma 3's sliding-window layers turn at 10^4 while its global
    layers turn at 10^6, stretched 8 times (``DecoderOptions.window_rope_theta``)."""
    length = length or args.max_seq_len
    if (device or torch.get_default_device()).type == "meta":
        # the shape alone: the math's meta kernels (arange, pow, polar) import torch._dynamo on their
        # first call, 0.3-1.6 s of a seed's serial start-up, for a table nothing reads on meta
        return torch.empty(length, rotary_dim(args) // 2, dtype=torch.complex64, device="meta")
    base, scaling = (args.rope_theta, args.rope_scaling) if theta is None else (theta, None)
    freqs, attention_factor = rope_frequencies(rotary_dim(args), base, scaling, device)
    return rope_table(freqs, attention_factor, length, device)


def rotary_dim(args) -> int:
    """The channels of each head RoPE turns: ``args.rotary_dim`` where a family turns part of each
    head (partial RoPE), else every one (``args.head_dim``)."""
    return getattr(args, "rotary_dim", args.head_dim)


def apply_rotary_emb(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs (x0, x1), (x2, x3), ... of ``x`` (bsz, seq, heads, head_dim).

    ``freqs_cis`` is ``(seq, head_dim // 2)`` (the same positions in every row) or
    ``(bsz, seq, head_dim // 2)`` (per-row positions, e.g. restarting at each packed document).
    A narrower table (partial RoPE) turns the first ``2 * freqs_cis.shape[-1]`` channels only.
    """
    turned = 2 * freqs_cis.shape[-1]
    if turned < x.shape[-1]:
        return torch.cat([apply_rotary_emb(x[..., :turned], freqs_cis), x[..., turned:]], dim=-1)
    x_complex = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    freqs = freqs_cis[None, :, None, :] if freqs_cis.dim() == 2 else freqs_cis[:, :, None, :]
    rotated = torch.view_as_real(x_complex * freqs).flatten(3)
    return rotated.type_as(x)
