"""OmniVoice on the worker: the model and its loader, the unmasking step, the packed layout, the canvas engine and the process that serves it."""
