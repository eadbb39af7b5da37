"""The Higgs-Audio-v2 codec (OmniVoice's audio tokenizer): transformers' HiggsAudioV2TokenizerModel
behind the two calls the vocoder needs, over whole clips of mono 24 kHz audio:

    encode([wave float32 [N]])   -> [codes int64 [N // 960, 8]]   (the tail past the last frame dropped)
    decode([codes int64 [T, 8]]) -> [wave float32 [960 * T]]

Always fp32: an fp16 codec decodes to digital silence. Built from a directory (the codec's own,
config.json + weights, or an OmniVoice checkpoint holding it in audio_tokenizer/) or from a preset
with random weights: "higgs-tiny" (small channels and one HuBERT layer, fast on CPU) and "higgs-full"
(the checkpoint's shapes, for GPU benchmarks). Both keep what the serving path depends on: 24 kHz,
hop 960 (25 frames/s), 8 quantizers of 1024 codes, and HuBERT's 320-sample stride at 16 kHz
(semantic frames halved to 25/s). The argument-less transformers config does not: it gives hop 320
and 5 quantizers.

Batching decode is exact only where measured so (`measure_batching`). The decoder is a stack of
non-causal convolutions, so frames appended after a clip reach back into its samples, and padding a
shorter clip to share a batch changes it. Random weights on CPU: a 10-frame clip padded by 3 frames
moves by more than 1e-6 from its 1089th sample on (up to a third of its peak) with the full shapes,
in its last ~110 samples with the tiny preset. So clips are never padded. Equal-length clips in one
forward differ from the same clips decoded alone on CPU (~1e-8 in fp32, ~1e-17 in fp64; batches of
2 and 3 agree with each other, not with a lone clip), so on CPU every clip is decoded alone. On
another device the startup measurement decides whether equal lengths share a forward.
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import numpy as np
import torch

from vocoder_svc import sinc_resample, snake

CODEC_NAME = "higgs_audio_v2"
MODEL_TYPE = "higgs_audio_v2_tokenizer"
SAMPLE_RATE = 24000
SAMPLES_PER_FRAME = 960
NUM_CODEBOOKS = 8
CODEBOOK_SIZE = 1024
_RATIOS = [8, 5, 4, 2, 3]  # DAC strides: 960 samples per frame at 24 kHz
_PACKAGE = "transformers.models.higgs_audio_v2_tokenizer"


class CodecInputError(ValueError):
    """Bad input to the codec; `field` names the request field at fault."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


def _resamples(torchaudio_module) -> bool:
    try:
        return tuple(torchaudio_module.functional.resample(torch.zeros(1, 3), 3, 2).shape) == (1, 2)
    except Exception:  # noqa: BLE001 - absent, or a stand-in that refuses
        return False


def _model_classes():
    """(HiggsAudioV2TokenizerConfig, HiggsAudioV2TokenizerModel). The model module imports torchaudio
    only to resample to 16 kHz. Where torchaudio does not import it is imported beside sinc_resample's
    equivalent (sys.modules is left as it was), and whatever it holds that cannot resample (a test
    stand-in that refuses, say) is replaced by that equivalent."""
    config_module = importlib.import_module(f"{_PACKAGE}.configuration_higgs_audio_v2_tokenizer")
    name = f"{_PACKAGE}.modeling_higgs_audio_v2_tokenizer"
    model_module = sys.modules.get(name)
    if model_module is None:
        try:
            import torchaudio  # noqa: F401
            stand_in = None
        except Exception:  # noqa: BLE001 - missing, or a build that cannot load beside this torch
            stand_in = sinc_resample.stand_in_module()
        previous = sys.modules.get("torchaudio")
        if stand_in is not None:
            sys.modules["torchaudio"] = stand_in
        try:
            model_module = importlib.import_module(name)
        finally:
            if stand_in is not None:
                if previous is None:
                    sys.modules.pop("torchaudio", None)
                else:
                    sys.modules["torchaudio"] = previous
    if not _resamples(getattr(model_module, "torchaudio", None)):
        model_module.torchaudio = sinc_resample.stand_in_module()
    return config_module.HiggsAudioV2TokenizerConfig, model_module.HiggsAudioV2TokenizerModel


# ---- configs -------------------------------------------------------------------------------------

def _config(acoustic: dict, semantic: dict, codebook_dim: int):
    config_class, _ = _model_classes()
    return config_class(
        sample_rate=SAMPLE_RATE, semantic_sample_rate=16000, downsample_factor=320,
        target_bandwidths=[0.5, 1, 1.5, 2],  # 2 kbps / (25 frames/s * 10 bits) = 8 quantizers
        codebook_size=CODEBOOK_SIZE, codebook_dim=codebook_dim,
        acoustic_model_config={"downsampling_ratios": _RATIOS, "upsampling_ratios": _RATIOS, **acoustic},
        semantic_model_config=semantic)


def full_config():
    """The OmniVoice checkpoint's codec shapes (HuBERT-base semantic model)."""
    return _config({"encoder_hidden_size": 64, "decoder_hidden_size": 1024, "hidden_size": 256}, {}, 64)


def tiny_config():
    """Small channels with the full config's rates and strides. The DAC decoder halves its width at
    each of its 5 upsampling stages, so 32 is its least width; HuBERT keeps its 7 feature convolutions
    (stride 320) with 8 channels, one layer of 2 heads."""
    acoustic = {"encoder_hidden_size": 2, "decoder_hidden_size": 32, "hidden_size": 8,
                "n_codebooks": 1, "codebook_dim": 1}  # DAC's own quantizer is built, then dropped
    semantic = {"hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
                "conv_dim": [8] * 7, "num_conv_pos_embeddings": 4, "num_conv_pos_embedding_groups": 2}
    return _config(acoustic, semantic, 8)


PRESETS = {"higgs-tiny": tiny_config, "higgs-full": full_config}


def check_config(config) -> None:
    """The derived properties the service relies on; ValueError naming the first one that differs."""
    facts = {"sample_rate": (config.sample_rate, SAMPLE_RATE), "hop_length": (config.hop_length, SAMPLES_PER_FRAME),
             "num_quantizers": (config.num_quantizers, NUM_CODEBOOKS),
             "codebook_size": (config.codebook_size, CODEBOOK_SIZE)}
    for key, (got, want) in facts.items():
        if got != want:
            raise ValueError(f"Higgs codec config: {key} is {got}; OmniVoice's codec has {want}")


def codec_dir(path: str | Path) -> Path | None:
    """The directory holding a Higgs codec's config.json: `path` itself or its audio_tokenizer/
    (an OmniVoice checkpoint); None when neither holds one."""
    for candidate in (Path(path), Path(path) / "audio_tokenizer"):
        try:
            config = json.loads((candidate / "config.json").read_text())
        except (OSError, ValueError):
            continue
        if isinstance(config, dict) and config.get("model_type") == MODEL_TYPE:
            return candidate
    return None


# ---- the codec -----------------------------------------------------------------------------------

class HiggsCodec:
    """A HiggsAudioV2TokenizerModel in fp32 on one device. Calls are not thread-safe: the vocoder
    runs them on one thread."""

    name = CODEC_NAME
    sample_rate = SAMPLE_RATE
    hop = SAMPLES_PER_FRAME
    num_codebooks = NUM_CODEBOOKS
    codebook_size = CODEBOOK_SIZE
    channels = 1

    def __init__(self, model, device: str | torch.device = "cpu", fused_snake: bool = True):
        """fused_snake: where the kernels compile, run each Snake activation as one launch and add the
        residual units' convolution biases in the launches after them (snake.py: torch's bits)."""
        check_config(model.config)
        self.device = torch.device(device)
        self.model = model.to(device=self.device, dtype=torch.float32).eval()
        if fused_snake and snake.kernel_compiles(self.device):
            snake.fuse_snakes(self.model)
        self.batch_equal_lengths = False  # set by measure_batching

    @classmethod
    def from_dir(cls, path: str | Path, device: str | torch.device = "cpu", fused_snake: bool = True) -> "HiggsCodec":
        where = codec_dir(path)
        if where is None:
            raise ValueError(f"{path}: no Higgs-Audio-v2 codec here (a config.json with model_type "
                             f"{MODEL_TYPE!r}, in the directory or in its audio_tokenizer/)")
        _, model_class = _model_classes()
        return cls(model_class.from_pretrained(str(where), dtype=torch.float32), device, fused_snake)

    @classmethod
    def from_preset(cls, preset: str, seed: int = 0, device: str | torch.device = "cpu",
                    fused_snake: bool = True) -> "HiggsCodec":
        """Random weights, deterministic in (preset, seed): drawn on the CPU, then moved."""
        if preset not in PRESETS:
            raise ValueError(f"unknown Higgs codec preset {preset!r}; choose one of {sorted(PRESETS)}")
        _, model_class = _model_classes()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = model_class(PRESETS[preset]())
            # The model's own init leaves the codebooks at zero, which would make every code decode alike.
            with torch.no_grad():
                for quantizer in model.quantizer.quantizers:
                    quantizer.codebook.embed.normal_()
        return cls(model, device, fused_snake)

    # ---- encode ------------------------------------------------------------------------------
    def encode(self, waves: list[np.ndarray]) -> list[np.ndarray]:
        """Mono 24 kHz float waves -> int64 codes [N // 960, 8] each (one forward per wave)."""
        out = []
        for i, wave in enumerate(waves):
            x = np.asarray(wave)
            if x.ndim != 1 or not np.issubdtype(x.dtype, np.floating):
                raise CodecInputError("audio", f"clip {i}: expected a mono float wave [samples], got "
                                      f"{x.dtype} {list(x.shape)}")
            frames = len(x) // self.hop
            if frames < 1:
                raise CodecInputError("audio", f"clip {i}: {len(x)} samples is shorter than one codec frame "
                                      f"({self.hop} samples, 40 ms)")
            if not np.isfinite(x).all():
                raise CodecInputError("audio", f"clip {i}: contains NaN or Inf samples")
            x = torch.from_numpy(np.ascontiguousarray(x[:frames * self.hop], dtype=np.float32))
            with torch.inference_mode():
                codes = self.model.encode(x.to(self.device)[None, None], return_dict=False)  # [1, 8, F]
            out.append(codes[0].T.to("cpu", torch.int64).numpy())
        return out

    # ---- decode ------------------------------------------------------------------------------
    def check_codes(self, codes: np.ndarray, field: str = "codes") -> np.ndarray:
        """codes as int64 [T, 8] with T >= 1 and every code in [0, 1024); CodecInputError otherwise."""
        c = np.asarray(codes)
        if c.ndim != 2 or c.shape[1] != self.num_codebooks:
            raise CodecInputError(field, f"expected [frames, {self.num_codebooks}] codes, got shape {list(c.shape)}")
        if c.shape[0] < 1:
            raise CodecInputError(field, "no frames: a clip needs at least one")
        if not np.issubdtype(c.dtype, np.integer):
            raise CodecInputError(field, f"codes must be integers, got {c.dtype}")
        bad = (c < 0) | (c >= self.codebook_size)
        if bad.any():
            t, q = (int(v) for v in np.argwhere(bad)[0])
            raise CodecInputError(field, f"code {int(c[t, q])} at frame {t}, codebook {q} is outside "
                                  f"[0, {self.codebook_size})")
        return c.astype(np.int64, copy=False)

    def _forward(self, batch: list[np.ndarray]) -> list[np.ndarray]:
        codes = torch.from_numpy(np.stack([c.T for c in batch])).to(self.device)  # [B, 8, T]
        with torch.inference_mode():
            wave = self.model.decode(codes, return_dict=False)  # [B, 1, 960 T]
        wave = wave[:, 0].float()
        if wave.is_cuda:  # through pinned memory: a pageable copy stages and runs at a fraction of the bus
            host = torch.empty(wave.shape, dtype=wave.dtype, pin_memory=True)
            host.copy_(wave, non_blocking=True)
            torch.cuda.current_stream(wave.device).synchronize()
            wave = host
        return [np.ascontiguousarray(w) for w in wave.numpy()]

    def decode(self, clips: list[np.ndarray]) -> list[np.ndarray]:
        """[T, 8] codes each -> float32 [960 T] each, in order. Equal-length clips share a forward
        when measure_batching found that exact; otherwise each clip runs alone."""
        clips = [self.check_codes(c, "codes" if len(clips) == 1 else f"codes[{i}]") for i, c in enumerate(clips)]
        out: list[np.ndarray | None] = [None] * len(clips)
        for members in self.forward_groups([len(c) for c in clips]):
            for i, wave in zip(members, self._forward([clips[i] for i in members])):
                out[i] = wave
        return out

    def forward_groups(self, lengths: list[int]) -> list[list[int]]:
        """The indices of the clips decode runs in each forward: equal lengths together when
        measure_batching found that exact, else one clip each."""
        groups: dict[int, list[int]] = {}
        for i, n in enumerate(lengths):
            groups.setdefault(n if self.batch_equal_lengths else -1 - i, []).append(i)
        return list(groups.values())

    def measure_batching(self, lengths: tuple[int, ...] = (1, 7, 25), seed: int = 0) -> str | None:
        """Decode clips of each length alone and 2 and 3 to a forward; set batch_equal_lengths when
        every batched clip equals its solo decode bit for bit. Returns None then, else what differed.
        A sample of shapes, not a proof: kernels may still change with shapes not tried here."""
        rng = np.random.default_rng(seed)
        self.batch_equal_lengths = False
        for t in lengths:
            clips = [rng.integers(0, self.codebook_size, size=(t, self.num_codebooks)) for _ in range(3)]
            solo = [self._forward([c])[0] for c in clips]
            for n in (2, 3):
                for b, wave in enumerate(self._forward(clips[:n])):
                    if not np.array_equal(wave, solo[b]):
                        diff = float(np.abs(wave - solo[b]).max())
                        return f"a {t}-frame clip batched with {n - 1} more differs from its solo decode by {diff:.3g}"
        self.batch_equal_lengths = True
        return None
