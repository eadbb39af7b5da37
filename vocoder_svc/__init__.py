"""vocoder_svc."""
