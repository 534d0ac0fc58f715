"""The broker's domain: messages, topics, channels, timeouts. No I/O; time is an argument."""
