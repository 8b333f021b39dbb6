"""The built-in engines (vLLM, lmi-dist, Hugging Face Accelerate), over the handler API."""
