"""The key tables of both CLIs' `--help` (`jaxpar.run.help`, `torchref.help`): one row per dataclass
field, (key, type, default, meaning), the meaning being the field's `doc` metadata
(`gpt2common.grammar.setting`). No jax, no torch."""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Iterator


def doc_of(f: dataclasses.Field) -> str:
    return f.metadata.get("doc", "")


def _type_name(tp) -> str:
    origin = typing.get_origin(tp)
    if origin is tuple:
        return f"{_type_name(typing.get_args(tp)[0])} list"
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if args and len(args) < len(typing.get_args(tp)):  # X | None
        return _type_name(args[0])
    return getattr(tp, "__name__", str(tp))


def _default_text(v) -> str:
    if v is None:
        return "none"
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, tuple):
        return ",".join(map(str, v)) or '""'
    if isinstance(v, str):
        return '""' if not v else (v if v.isprintable() and " " not in v else repr(v))
    return repr(v)


def rows(cls, prefix: str = "", instance=None, only: tuple[str, ...] | None = None,
         default: str | None = None, skip: tuple[str, ...] = ()) -> Iterator[tuple[str, str, str, str]]:
    """(key, type, default, meaning) of each field of dataclass `cls` (defaults from `instance`, else
    the class's); `default` replaces every default (e.g. "run's")."""
    types_ = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if (only is not None and f.name not in only) or f.name in skip:
            continue
        if dataclasses.is_dataclass(types_[f.name]):  # a Config section: listed by its own rows
            continue
        if default is not None:
            shown = default
        elif instance is not None:
            shown = _default_text(getattr(instance, f.name))
        else:
            shown = _default_text(f.default) if f.default is not dataclasses.MISSING else "required"
        yield prefix + f.name, _type_name(types_[f.name]), shown, doc_of(f)


def table(entries: list[tuple[str, str, str, str]]) -> str:
    w = [max(len(e[i]) for e in entries) for i in range(3)]
    return "\n".join(f"  {k:<{w[0]}}  {t:<{w[1]}}  {d:<{w[2]}}  {m}" for k, t, d, m in entries)
