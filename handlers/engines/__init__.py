"""The built-in engines (vLLM, which also serves lmi-dist configurations, and Hugging Face
Accelerate), over the handler API."""
