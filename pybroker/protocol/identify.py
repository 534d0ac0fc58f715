"""IDENTIFY bodies decoded the way nsqd's Go code decodes them into identifyDataV2.

Go's encoding/json is strict about types (a number is not a string, 1000.0 is not an
int, an int must fit its Go type) and matches keys case-insensitively when no key
matches exactly; a JSON ``null`` body or field leaves the defaults.
"""
from __future__ import annotations

import json
from typing import TypedDict, cast

# field -> (kind, bits): the Go types of identifyDataV2
FIELDS: dict[str, tuple[str, int]] = {
    "client_id": ("str", 0), "hostname": ("str", 0), "user_agent": ("str", 0),
    "heartbeat_interval": ("int", 64), "output_buffer_size": ("int", 64),
    "output_buffer_timeout": ("int", 64), "deflate_level": ("int", 64),
    "msg_timeout": ("int", 64), "sample_rate": ("int", 32),
    "feature_negotiation": ("bool", 0), "tls_v1": ("bool", 0), "deflate": ("bool", 0),
    "snappy": ("bool", 0),
}
_DEFAULTS = {"str": "", "int": 0, "bool": False}
_FOLDED = {k.lower(): k for k in FIELDS}


class IdentifyData(TypedDict):
    """identifyDataV2: what a client may set with IDENTIFY (zero values when absent)."""

    client_id: str
    hostname: str
    user_agent: str
    heartbeat_interval: int
    output_buffer_size: int
    output_buffer_timeout: int
    deflate_level: int
    msg_timeout: int
    sample_rate: int
    feature_negotiation: bool
    tls_v1: bool
    deflate: bool
    snappy: bool


class IdentifyDecodeError(ValueError):
    pass


def decode_identify(body: bytes) -> IdentifyData:
    """Every identifyDataV2 field, typed, with Go's zero values for absent ones."""
    try:
        # Go reads the body as UTF-8 and turns bytes that are not into U+FFFD
        data = json.loads(body.decode("utf-8", "replace"))
    except (ValueError, UnicodeDecodeError, RecursionError):
        # RecursionError: nested deeper than Python's JSON decoder goes (Go's stops at
        # 10,000 levels); ValueError also covers integers past the int-string limit
        raise IdentifyDecodeError("not JSON") from None
    out: dict[str, object] = {k: _DEFAULTS[kind] for k, (kind, _) in FIELDS.items()}
    if data is None:
        return cast(IdentifyData, out)
    if not isinstance(data, dict):
        raise IdentifyDecodeError("not an object")
    exact = {k for k in data if k in FIELDS}
    for key, value in data.items():
        field = key if key in FIELDS else _FOLDED.get(key.lower())
        if field is None or (field != key and field in exact):
            continue  # unknown keys are ignored; an exact match wins over a folded one
        if value is None:
            continue
        kind, bits = FIELDS[field]
        if kind == "str" and not isinstance(value, str):
            raise IdentifyDecodeError(field)
        if kind == "bool" and not isinstance(value, bool):
            raise IdentifyDecodeError(field)
        if kind == "int":
            if isinstance(value, bool) or not isinstance(value, int):
                raise IdentifyDecodeError(field)
            if not -(1 << (bits - 1)) <= value < (1 << (bits - 1)):
                raise IdentifyDecodeError(field)
        out[field] = value
    return cast(IdentifyData, out)   # every field is there, of its kind (checked above)
