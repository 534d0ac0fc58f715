"""Sans-IO NSQ V2 protocol: bytes in, commands out; replies in, bytes out.

Nothing here owns a socket, selector, thread or clock.
"""
