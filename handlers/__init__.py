"""What a handler author reads, and what runs as a handler: the handler API
(``Input``/``Output``, also importable as LMI's ``djl_python``), loading of a
user's ``model.py``, and the built-in handlers (vLLM, which serves LMI's ``vllm`` and
``lmi-dist`` configurations alike, and Hugging Face Accelerate) with their request and response
schemas."""
