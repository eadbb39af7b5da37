"""The HTTP face of Chorus: an OpenAI-compatible speech API that translates to the public gRPC API."""
