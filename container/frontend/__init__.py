"""The HTTP frontend: a Flask app served by gunicorn (one process, many threads)
that relays requests to model workers over the worker protocol."""
