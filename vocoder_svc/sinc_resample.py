"""Band-limited resampling by a Hann-windowed sinc filter, numerically the same as torchaudio's
`functional.resample` at its defaults (6 zero crossings, roll-off 0.99).

The Higgs-Audio-v2 codec in transformers resamples its 24 kHz input to 16 kHz for HuBERT with
torchaudio, and torchaudio cannot be installed beside a CPU-only torch. Where it does not import,
vocoder_svc/higgs_codec.py hands the codec this function instead. Every operation runs in the
waveform's dtype and in torchaudio's order (filter taps built from float positions, then one strided
convolution), so codes encoded here equal codes encoded with torchaudio present.
"""

from __future__ import annotations

import math
import types

import torch
import torch.nn.functional as F


def _filter(down: int, up: int, zero_crossings: int, rolloff: float, dtype: torch.dtype,
            device: torch.device) -> tuple[torch.Tensor, int]:
    """The `up` polyphase filters [up, 1, taps] for a down:up rate ratio in lowest terms, and the
    half-width in input samples they reach."""
    cutoff = min(down, up) * rolloff  # in units of the reduced rates: below both Nyquists
    reach = math.ceil(zero_crossings * down / cutoff)
    offsets = torch.arange(-reach, reach + down, dtype=dtype, device=device)[None, None] / down
    phases = torch.arange(0, -up, -1, dtype=dtype, device=device)[:, None, None] / up
    x = (phases + offsets) * cutoff
    x = x.clamp_(-zero_crossings, zero_crossings)
    hann = torch.cos(x * math.pi / zero_crossings / 2) ** 2
    x = x * math.pi
    sinc = torch.where(x == 0, torch.tensor(1.0).to(x), x.sin() / x)
    return sinc * (hann * (cutoff / down)), reach


def resample(waveform: torch.Tensor, orig_freq: int, new_freq: int, lowpass_filter_width: int = 6,
             rolloff: float = 0.99) -> torch.Tensor:
    """[..., N] float at orig_freq -> [..., ceil(N * new / orig)] at new_freq."""
    if orig_freq <= 0 or new_freq <= 0:
        raise ValueError(f"resample: rates must be positive (got {orig_freq} -> {new_freq})")
    if orig_freq == new_freq:
        return waveform
    if not waveform.is_floating_point():
        raise TypeError(f"resample: expected a float waveform, got {waveform.dtype}")
    g = math.gcd(int(orig_freq), int(new_freq))
    down, up = int(orig_freq) // g, int(new_freq) // g
    taps, reach = _filter(down, up, lowpass_filter_width, rolloff, waveform.dtype, waveform.device)
    shape = waveform.shape
    rows = waveform.reshape(-1, shape[-1])
    n = rows.shape[1]
    padded = F.pad(rows, (reach, reach + down))
    out = F.conv1d(padded[:, None], taps, stride=down)  # [rows, up, steps]: phase-major per step
    out = out.transpose(1, 2).reshape(rows.shape[0], -1)
    keep = int(torch.ceil(torch.as_tensor(up * n / down)).item())
    return out[:, :keep].reshape(*shape[:-1], -1)


def stand_in_module() -> types.ModuleType:
    """A `torchaudio` module offering only functional.resample (what the codec calls)."""
    import importlib.machinery

    module = types.ModuleType("torchaudio")
    module.__spec__ = importlib.machinery.ModuleSpec("torchaudio", None)
    module.functional = types.SimpleNamespace(resample=resample)
    return module
