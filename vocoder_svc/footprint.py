"""The slot decoder's memory as chorus.sizing sees it, from the codec's config alone (no weights).

A slot holds every decoder Transformer's K and V over its attention window; a scratch row per
slot pads steps to their bucket (slot_decoder.py); a step's activations take about as much again
per row at 25-frame steps (one H200, 64 slots: 20.1 GB peak against 11.4 GB of slot and scratch
state and 4.2 GB of weights). Weights: the encoder's and the decoder's Transformers (the
projections and the quantizer are a rounding error).
"""

from __future__ import annotations

import json
from pathlib import Path

from chorus.sizing import CodecFootprint
from vocoder_svc.codec_config import CodecConfig, full_v2, tiny_v2
from vocoder_svc.config import VocoderConfig

DTYPE_BYTES = {"float32": 4, "float64": 8, "bfloat16": 2}
# slot state + scratch row + a step's activations, in units of one slot's K and V
SLOT_STATE_MULTIPLE = 3


def codec_config(args: VocoderConfig) -> CodecConfig:
    """The codec the service would load: --codec's config.json, else the preset (as make_codec picks)."""
    if args.codec:
        return CodecConfig.from_dict(json.loads((Path(args.codec) / "config.json").read_text()))
    return tiny_v2() if args.preset == "tiny" else full_v2()


def kv_bytes_per_slot(config: CodecConfig, dtype_bytes: int) -> int:
    windows = config.decoder_windows()
    return sum(2 * s.num_layers * windows[i] * s.d_model for i, s in enumerate(config.decoder)
               if not s.is_patch) * dtype_bytes


def weight_bytes(config: CodecConfig, dtype_bytes: int) -> int:
    params = sum(s.num_layers * (4 * s.d_model ** 2 + 2 * s.d_model * s.dim_feedforward)
                 + (s.input_dimension + s.output_dimension) * s.d_model
                 for s in (*config.encoder, *config.decoder) if not s.is_patch)
    return params * dtype_bytes


def footprint(args: VocoderConfig, config: CodecConfig | None = None) -> CodecFootprint:
    """The slot decoder's footprint under these settings (config: the codec's, else the one args name)."""
    config = config or codec_config(args)
    elt = DTYPE_BYTES[args.dtype]
    return CodecFootprint(weight_bytes=weight_bytes(config, elt),
                          slot_bytes=SLOT_STATE_MULTIPLE * kv_bytes_per_slot(config, elt))
