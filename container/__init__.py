"""The server side of sagelmi: the ``sagelmi`` command, settings resolution,
worker-group planning and supervision, and the HTTP frontend."""
