"""optiontypes.OptionFields declares every option of config.SPECS with the type config
resolves it to, and nothing else; and resolved Options hold values of those types."""
from __future__ import annotations

import typing

from pybroker.config import SPECS, Options, resolve
from pybroker.optiontypes import OptionFields

_BY_KIND = {"str": str, "int": int, "float": float, "bool": bool, "duration": int,
            "tls_required": int}


def _declared() -> dict[str, object]:
    return typing.get_type_hints(OptionFields)


def test_every_option_declared_with_its_kinds_type() -> None:
    hints = _declared()
    assert list(hints) == [s.key for s in SPECS]
    for s in SPECS:
        if s.kind == "list":
            want: object = (list[float] if s.key == "e2e_processing_latency_percentiles"
                            else list[str])
        else:
            want = _BY_KIND[s.kind]
        assert hints[s.key] == want, s.key


def test_resolved_values_have_the_declared_types() -> None:
    opts = resolve({"e2e_processing_latency_percentiles": ["0.99", 0.5],
                    "nsqlookupd_tcp_addresses": ["127.0.0.1:4160"]},
                   {"msg_timeout": "30s", "tls_required": "false"})
    assert isinstance(opts, Options)
    for key, hint in _declared().items():
        value = getattr(opts, key)
        origin = typing.get_origin(hint)
        if origin is list:
            (item,) = typing.get_args(hint)
            assert isinstance(value, list) and all(isinstance(v, item) for v in value), key
        else:
            assert isinstance(value, typing.cast(type, hint)) and (hint is bool or not isinstance(value, bool)), \
                (key, value)
