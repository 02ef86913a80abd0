"""The config grammar both CLIs speak: `key=value` arguments, YAML files flattened to dotted
keys, and the coercion of a raw value to a dataclass field's type.

What a key means (which keys exist, their defaults and checks) is each side's own business:
`jaxpar.config` and `torchref.config` build their frozen dataclasses on top of this grammar.
"""

from __future__ import annotations

import difflib
import math
import types
import typing
from dataclasses import MISSING, field, fields
from typing import Any


class ConfigError(ValueError):
    """Invalid configuration or input. The CLIs print `error: <msg>` and exit 2."""


# str.splitlines' line boundaries: a value echoed into an error message must not break its line
_LINE_BREAKS = "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"


def one_line(msg: str) -> str:
    """`msg` with every line break escaped as Python writes it in a literal ('a\\nb'), so the
    CLIs' `error: <msg>` stays one line whatever value (a path, a group name) it quotes."""
    return "".join(repr(c)[1:-1] if c in _LINE_BREAKS else c for c in msg)


def naming_key(msg: str, key: str, value: str) -> str:
    """`msg`, a message about the path `value`, naming the key the user gave it by: "'p' is not ..."
    becomes "key='p' is not ...", any other message gets "key='p': " in front."""
    return f"{key}={msg}" if msg.startswith(repr(value)) else f"{key}={value!r}: {msg}"


def parse_value(tp: Any, raw: Any, key: str) -> Any:
    """Coerce `raw` (a CLI string or a YAML value) to the dataclass field type `tp`."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if raw is None or (isinstance(raw, str) and raw.lower() in ("none", "null", "")):
            return None
        return parse_value(args[0], raw, key)
    if origin is tuple:
        (elem, _) = typing.get_args(tp)
        if isinstance(raw, str):
            raw = raw.strip().strip("[]()")
            items = [s for s in raw.replace(" ", "").split(",") if s]
        else:
            items = list(raw)
        return tuple(parse_value(elem, x, key) for x in items)
    if tp is bool:
        if isinstance(raw, bool):
            return raw
        s = str(raw).lower()
        if s in ("true", "1", "yes", "on"):
            return True
        if s in ("false", "0", "no", "off"):
            return False
        raise ConfigError(f"{key}={raw!r} is not a boolean (true/false)")
    if tp in (int, float):
        try:
            if tp is int and isinstance(raw, str) and raw.strip().lower().endswith(("e", "e+")):
                raise ValueError
            v = float(raw) if tp is float else int(str(raw).replace("_", ""))
        except (TypeError, ValueError, OverflowError):
            raise ConfigError(f"{key}={raw!r} is not a{'n integer' if tp is int else ' number'}") from None
        if tp is float and not math.isfinite(v):  # nan/inf parse as floats but make no setting meaningful
            raise ConfigError(f"{key}={raw!r} is not a finite number")
        return v
    if raw is None:  # YAML `key: ~` / `key:` (str(None) made `out: ~` train into a dir named None)
        raise ConfigError(f"{key} is null in the config file; give it a value or leave it out")
    return str(raw)


def setting(default: Any = MISSING, doc: str = "", *, factory: Any = MISSING) -> Any:
    """A dataclass field with its one-line meaning: the CLIs' `--help` prints it beside the key's
    type and default (`jaxpar.run.help`), so a key and its documentation are written in one place."""
    return field(default=default, default_factory=factory, metadata={"doc": doc})


def field_types(cls) -> dict[str, Any]:
    """{field name: resolved type} of a dataclass (string annotations evaluated)."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in fields(cls)}


def section_given_a_value(section: str, raw: Any, first_key: str) -> ConfigError:
    """`train=5` on the command line, or `train: [1, 2]` in a YAML file: a section takes keys, not
    a value (both CLIs said "unknown key 'train'" of a section they list)."""
    return ConfigError(f"{section}={raw!r}: {section} is a section, not a key; set its keys "
                       f"({section}.{first_key}=..., or a mapping under `{section}:` in YAML)")


def flatten_yaml(doc: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{'train': {'steps': 5}} -> {'train.steps': 5}; `model: gpt2` stays a preset key. A key
    given both dotted and nested (`train.steps: 3` and `train: {steps: 4}`) is a ValueError
    naming it: one of the two would be dropped without a word."""
    out: dict[str, Any] = {}
    for k, v in doc.items():
        key = f"{prefix}{k}"
        flat = flatten_yaml(v, key + ".") if isinstance(v, dict) else {key: v}
        for twice in flat.keys() & out.keys():
            raise ValueError(twice)
        out.update(flat)
    return out


def _unique_keys_loader(path: str):
    """yaml.SafeLoader that refuses a key given twice in one mapping (YAML says keys are unique;
    PyYAML keeps the last, so `lr: 1e-3` ... `lr: 3e-4` trained on the second without a word)."""
    import yaml

    class Loader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=deep)
                line = key_node.start_mark.line + 1
                try:
                    first = seen.get(key)
                except TypeError:  # an unhashable key: SafeLoader's own error follows
                    continue
                if first is not None:
                    raise ConfigError(f"config file {path!r} gives {key!r} twice (lines {first} and {line}); "
                                      "a key takes one value")
                seen[key] = line
            return super().construct_mapping(node, deep)

    return Loader


def unknown_key(key: str, known, valid: str = "") -> ConfigError:
    """`unknown key 'steps' (did you mean train.steps?)`: the known keys whose last part is the given
    one's (a section left out: steps -> train.steps), else difflib's closest keys (a typo: trian.steps),
    else the keys whose last part is closest to its (stepz -> train.steps); at most 3. `valid`, when
    given, lists the section's keys instead of guessing."""
    if valid:
        return ConfigError(f"unknown key {key!r} (valid: {valid})")
    known = [k for k in known if k != key]
    leaf = key.rpartition(".")[2]
    leaves = {}  # last part -> the keys that end in it
    for k in known:
        leaves.setdefault(k.rpartition(".")[2], []).append(k)
    guesses = (leaves.get(leaf) or difflib.get_close_matches(key, known, n=3)
               or [k for near in difflib.get_close_matches(leaf, list(leaves), n=1) for k in leaves[near]])[:3]
    return ConfigError(f"unknown key {key!r}" + (f" (did you mean {' or '.join(guesses)}?)" if guesses else ""))


def given_twice(key: str, first: str, second: str) -> ConfigError:
    """The one refusal of an option given twice, everywhere (a config key excepted: it takes its last
    value): `--config`, a command's inputs and outputs, bisect's a=/b= and a side's hf=, plan's own
    keys, launch's keys. Silently taking the last would drop the first."""
    return ConfigError(f"{key}= given twice ({first!r} and {second!r}); it takes one value")


def parse_kv(args: list[str], once=()) -> dict[str, str]:
    """['a.b=1', 'c=x'] -> {'a.b': '1', 'c': 'x'}.

    A repeated config key takes its last value, so `train $COMMON train.steps=10` overrides.
    The keys in `once` (a command's inputs and outputs: `run=`, `checkpoint=`, `to_hf=`; or
    `once=True`, every key) may be given only once: `plot run=a run=b` would otherwise plot b
    and silently drop a."""
    out: dict[str, str] = {}
    for a in args:
        key, sep, val = a.partition("=")
        if not sep or not key:
            raise ConfigError(f"argument {a!r} is not key=value")
        if key in out and (once is True or key in once):
            raise given_twice(key, out[key], val)
        out[key] = val
    return out


YAML_MAX_DEPTH = 32  # the deepest config is a list in a section (3); more is no config at all


def _check_bounded(path: str, events) -> None:
    """Refuse, from the parser's event stream (flat, no recursion, nothing built yet), what would
    make loading unbounded: an alias (a few hundred bytes of `&a`/`*a` nest into hundreds of
    millions of keys once flattened) and nesting past YAML_MAX_DEPTH (PyYAML builds nodes
    recursively: a RecursionError)."""
    import yaml

    depth = 0
    for ev in events:
        if isinstance(ev, yaml.AliasEvent):
            raise ConfigError(f"config file {path!r} uses a YAML alias (*{ev.anchor} at line {ev.start_mark.line + 1}); "
                              "config files take plain values only")
        if isinstance(ev, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
            depth += 1
            if depth > YAML_MAX_DEPTH:
                raise ConfigError(f"config file {path!r} nests deeper than {YAML_MAX_DEPTH} levels "
                                  f"(line {ev.start_mark.line + 1})")
        elif isinstance(ev, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
            depth -= 1


def load_yaml(path: str) -> dict[str, Any]:
    """`--config FILE.yaml` -> flat {dotted key: value}; every failure is one ConfigError line."""
    import yaml

    try:
        with open(path) as f:
            text = f.read()
        _check_bounded(path, yaml.parse(text))
        doc = yaml.load(text, Loader=_unique_keys_loader(path)) or {}  # noqa: S506 - a SafeLoader
    except FileNotFoundError:
        raise ConfigError(f"config file {path!r} does not exist") from None
    except IsADirectoryError:
        raise ConfigError(f"config file {path!r} is a directory") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file {path!r} cannot be read ({getattr(e, 'strerror', None) or e})") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path!r} is not valid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"config file {path!r} must hold a mapping of keys")
    try:
        return flatten_yaml(doc)
    except ValueError as e:
        raise ConfigError(f"config file {path!r} gives {e} twice (dotted and nested); a key takes one value") from None
