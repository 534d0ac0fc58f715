"""Client configuration: go-nsq's Config options under go-nsq's names, in seconds.

Every duration is a float number of seconds (go-nsq uses time.Duration). ``Config.set()``
accepts the strings tools pass through ``--consumer-opt``/``--producer-opt``
("max_in_flight,100", "msg_timeout,5s"), as go-nsq's ConfigFlag does.
"""
from __future__ import annotations

import dataclasses
import random
import re
import socket
from dataclasses import dataclass, field
from typing import Callable

from pybroker import __version__

_DURATION_RE = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")
_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(text: str) -> float:
    """Parse a Go duration ("1m30s", "250ms", "-1s", "0") into seconds.

    Raises:
        ValueError: if the text is not a Go duration.
    """
    s = text.strip()
    sign = 1.0
    if s[:1] in ("-", "+"):
        sign = -1.0 if s[0] == "-" else 1.0
        s = s[1:]
    if s == "0":
        return 0.0
    pos, total = 0, 0.0
    while pos < len(s):
        m = _DURATION_RE.match(s, pos)
        if m is None:
            raise ValueError(f"invalid duration {text!r}")
        total += float(m.group(1)) * _UNITS[m.group(2)]
        pos = m.end()
    if not s:
        raise ValueError(f"invalid duration {text!r}")
    return sign * total


def exponential_backoff(multiplier: float) -> Callable[[int], float]:
    """go-nsq's ExponentialStrategy: ``multiplier * 2**attempt`` seconds."""
    return lambda attempt: multiplier * (2 ** attempt)


def full_jitter_backoff(multiplier: float) -> Callable[[int], float]:
    """go-nsq's FullJitterStrategy: uniform in ``[0, multiplier * 2**attempt)``."""
    return lambda attempt: random.random() * multiplier * (2 ** attempt)


def _short_hostname() -> str:
    return socket.gethostname().split(".")[0]


@dataclass
class Config:
    """Options of a Consumer or Producer; names and defaults follow go-nsq.

    Durations are seconds. ``-1`` disables heartbeats / output buffering as in go-nsq.
    """

    dial_timeout: float = 1.0
    read_timeout: float = 60.0
    write_timeout: float = 1.0
    lookupd_poll_interval: float = 60.0
    lookupd_poll_jitter: float = 0.3
    lookupd_poll_timeout: float = 60.0
    max_requeue_delay: float = 900.0
    default_requeue_delay: float = 90.0
    backoff_strategy: str = "exponential"     # or "full_jitter"
    max_backoff_duration: float = 120.0
    backoff_multiplier: float = 1.0
    max_attempts: int = 5
    low_rdy_idle_timeout: float = 10.0
    low_rdy_timeout: float = 30.0
    rdy_redistribute_interval: float = 5.0
    client_id: str = field(default_factory=_short_hostname)
    hostname: str = field(default_factory=socket.gethostname)
    user_agent: str = f"pybroker-client/{__version__}"
    heartbeat_interval: float = 30.0
    sample_rate: int = 0
    output_buffer_size: int = 16384
    output_buffer_timeout: float = 0.25
    max_in_flight: int = 1
    msg_timeout: float = 0.0                  # 0: the server's default
    auth_secret: str = ""
    # negotiated in IDENTIFY, as go-nsq's tls_v1, snappy and deflate options; the tls_*
    # options are go-nsq's tls_config settings (tls_v1 must still be asked for)
    tls_v1: bool = False
    tls_root_ca_file: str = ""
    tls_insecure_skip_verify: bool = False
    tls_cert: str = ""
    tls_key: str = ""
    tls_min_version: str = ""                 # "tls1.0".."tls1.3"
    snappy: bool = False
    deflate: bool = False
    deflate_level: int = 6

    def backoff_duration(self, attempt: int) -> float:
        """Seconds to back off at backoff level ``attempt`` (1, 2, ...)."""
        if self.backoff_strategy == "full_jitter":
            return full_jitter_backoff(self.backoff_multiplier)(attempt)
        return exponential_backoff(self.backoff_multiplier)(attempt)

    def identify_fields(self) -> dict[str, object]:
        """The IDENTIFY body (milliseconds on the wire; -1 keeps its "disabled" meaning)."""
        def ms(value: float) -> int:
            return -1 if value == -1 else int(value * 1000)

        return {
            "client_id": self.client_id, "hostname": self.hostname,
            "user_agent": self.user_agent, "feature_negotiation": True,
            "heartbeat_interval": ms(self.heartbeat_interval),
            "sample_rate": self.sample_rate, "output_buffer_size": self.output_buffer_size,
            "output_buffer_timeout": ms(self.output_buffer_timeout),
            "msg_timeout": int(self.msg_timeout * 1000),
            "tls_v1": self.tls_v1, "snappy": self.snappy, "deflate": self.deflate,
            "deflate_level": self.deflate_level,
        }

    def validate(self) -> None:
        """Raises ValueError for values go-nsq would reject."""
        if self.max_in_flight < 0:
            raise ValueError("max_in_flight must be >= 0")
        if not 0 <= self.max_attempts <= 65535:
            raise ValueError("max_attempts must be within 0..65535")
        if not 0 <= self.sample_rate <= 99:
            raise ValueError("sample_rate must be within 0..99")
        if not 0.0 <= self.lookupd_poll_jitter <= 1.0:
            raise ValueError("lookupd_poll_jitter must be within 0..1")
        if not 1 <= self.deflate_level <= 9:
            raise ValueError("deflate_level must be within 1..9")
        if self.snappy and self.deflate:
            raise ValueError("snappy and deflate cannot both be enabled")
        if self.tls_min_version.lower() not in ("", "tls1.0", "tls1.1", "tls1.2", "tls1.3"):
            raise ValueError(f"unknown tls_min_version {self.tls_min_version!r}")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("tls_cert and tls_key must be given together")
        if self.backoff_strategy not in ("exponential", "full_jitter"):
            raise ValueError(f"unknown backoff_strategy {self.backoff_strategy!r}")
        for name in ("dial_timeout", "lookupd_poll_interval", "rdy_redistribute_interval"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")

    def set(self, option: str, value: object) -> None:
        """Set one option by go-nsq name; strings are parsed (durations as Go durations).

        Raises:
            ValueError: unknown option or unparsable value.
        """
        name = option.strip().replace("-", "_")
        fields = {f.name: f for f in dataclasses.fields(self)}
        if name not in fields:
            raise ValueError(f"invalid option {option}")
        current = getattr(self, name)
        if isinstance(value, str) and not isinstance(current, str):
            parsed: object
            if isinstance(current, bool):
                parsed = value.strip().lower() in ("1", "t", "true", "yes")
            elif isinstance(current, int):
                parsed = int(value)
            else:
                parsed = parse_duration(value) if re.search(r"[a-z]", value) else float(value)
            value = parsed
        setattr(self, name, value)

    def set_flag(self, text: str) -> None:
        """Apply a ``name,value`` string as given to ``--consumer-opt``."""
        name, sep, value = text.partition(",")
        if not sep:
            value = "true"
        self.set(name, value)

    def copy(self, **changes: object) -> "Config":
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]
