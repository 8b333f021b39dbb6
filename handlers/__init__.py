"""Code that runs inside each model worker process: the worker loop, the handler
API (``Input``/``Output``), handler loading, and the wire protocol it speaks."""
