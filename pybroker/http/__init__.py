"""nsqd's HTTP API (server.py: the http thread; api.py: the endpoints)."""
