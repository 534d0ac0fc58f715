"""pybroker.bench: the load generator and the pybroker-vs-nsqd comparison runner.

``pybroker bench`` (and ``python loadtest/bench.py``) measure publish and consume
throughput, end-to-end latency at a fixed rate, and memory per queued message, with
raw-socket load processes modelled on nsq's bench_writer/bench_reader; ``--vs-nsqd PATH``
runs the same scenarios on a real nsqd in the same invocation and prints the ratios.
Standard library only, except matplotlib for ``--plot``. Imports nothing of the broker.
"""
from pybroker.bench.cli import register

__all__ = ["register"]
