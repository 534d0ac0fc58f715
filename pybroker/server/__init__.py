"""The only package that owns sockets, selectors and threads."""
