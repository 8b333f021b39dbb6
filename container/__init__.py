"""The serving runtime: the ``sagelmi`` command, settings resolution, worker
groups and their supervision, the HTTP frontend, the model worker runtime, the
wire protocol between them and the error table they share."""
