"""OmniVoice (k2-fsa/OmniVoice): what the frontend, the worker and the vocoder share.

A masked-diffusion TTS: a bidirectional Qwen3 body refines a canvas of 8 codebooks of the
Higgs-Audio-v2 codec (25 frames/s, 24 kHz mono) over a fixed number of unmasking steps.
Facts: ../shared/specs/omnivoice.md.
"""
