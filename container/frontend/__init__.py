"""The HTTP frontend: a Flask app served by gunicorn (one process, many threads)
that relays requests to worker groups over the wire protocol."""
