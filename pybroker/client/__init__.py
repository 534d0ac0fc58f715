"""pybroker.client: an NSQ client built on plain threads and selectors (no asyncio).

Works against pybroker and against a real nsqd. Concepts and names follow go-nsq::

    from pybroker.client import Consumer, Producer

    with Producer("127.0.0.1:4150") as p:
        p.publish("events", b"hello")                 # blocking PUB
        futs = [p.publish_async("events", b"x%d" % i) for i in range(100)]  # pipelined
        p.multi_publish("events", [b"a", b"b"])       # MPUB
        p.deferred_publish("events", 5.0, b"later")   # DPUB, seconds

    def handle(msg):            # return -> FIN, raise -> REQ with backoff
        print(msg.body)

    c = Consumer("events", "archive", handle, max_in_flight=100)
    c.connect_to_nsqlookupd("127.0.0.1:4161")        # or c.connect_to_nsqd("host:4150")
    ...
    c.close()                   # CLS, drain in-flight, stop

Durations in ``Config`` are seconds. A Consumer exposes its connections (``conns()``,
each with ``rdy_count``, ``in_flight``, ``max_rdy_count``) and an ``on_rdy`` hook.
"""
from pybroker.client.config import Config, parse_duration
from pybroker.client.conn import Conn
from pybroker.client.consumer import Consumer, ConsumerStats, random_ephemeral_channel
from pybroker.client.errors import (AuthError, IdentifyError, NotConnectedError, NSQError,
                                    ProtocolError, StoppedError)
from pybroker.client.message import Message
from pybroker.client.producer import Producer
from pybroker.client.protocol import (IdentifyResponse, is_valid_channel_name,
                                      is_valid_topic_name)

__all__ = [
    "AuthError", "Config", "Conn", "Consumer", "ConsumerStats", "IdentifyError",
    "IdentifyResponse", "Message", "NSQError", "NotConnectedError", "Producer",
    "ProtocolError", "StoppedError", "is_valid_channel_name", "is_valid_topic_name",
    "parse_duration", "random_ephemeral_channel",
]
