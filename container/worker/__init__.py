"""The model worker: the program every rank of a worker group runs (``python -m container.worker``)."""
