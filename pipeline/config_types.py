"""The JSON types of a checkpoint's config files, checked before any value is used: a value of the
wrong type (a string where an object belongs, an object where a number does) is one CheckpointError
naming the file and the key, rather than an AttributeError or TypeError from inside a constructor.

A schema maps each JSON key the loaders read to what its value must be: a type (int, float, bool,
str, list[int], dict[str, int], X | None), a config dataclass (its fields by their annotations), or
a nested schema. Keys a schema does not name are not read, so their values do not matter; an absent
key takes its default, and so does a null object (the loaders read `x or {}`)."""
from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any

from pipeline.errors import CheckpointError

Schema = dict[str, Any]
ROPE = {"rope_theta": float}  # transformers 5 writes rope_theta in rope_parameters


def dataclass_schema(cls: type, extra: dict[type, Schema] | None = None) -> Schema:
    """The fields of the config dataclass `cls` by their annotations (a dataclass field as its own
    schema), with the keys `extra[cls]` that its from_dict reads besides its fields."""
    extra = extra or {}
    hints = typing.get_type_hints(cls)
    schema = {f.name: _expected(hints[f.name], extra) for f in dataclasses.fields(cls)}
    return schema | extra.get(cls, {})


def _expected(hint: Any, extra: dict[type, Schema]) -> Any:
    return dataclass_schema(hint, extra) if dataclasses.is_dataclass(hint) else hint


def check_config(path: Path, data: Any, schema: Schema) -> None:
    """CheckpointError naming `path` and the key where `data` holds a value of another type than `schema` gives."""
    problem = config_problem(data, schema)
    if problem is not None:
        raise CheckpointError(f"{path}: {problem}")


def config_problem(data: Any, schema: Schema) -> str | None:
    """The first value of `data` whose type is not the one `schema` gives, as a sentence naming its key; None if there is none."""
    return _problem(data, schema, "")


def _problem(value: Any, expected: Any, where: str) -> str | None:
    """What is wrong with `value` at `where` (None: nothing)."""
    if isinstance(expected, dict):
        return _object_problem(value, expected, where)
    if typing.get_origin(expected) in (typing.Union, types.UnionType):
        expected = next((option for option in typing.get_args(expected) if _fits(value, option)), expected)
    if _fits(value, expected):
        origin, args = typing.get_origin(expected), typing.get_args(expected)
        if origin is list:
            return next((p for i, item in enumerate(value) if (p := _problem(item, args[0], f"{where}[{i}]"))), None)
        if origin is dict:
            return next((p for key, item in value.items() if (p := _problem(item, args[1], f"{where}.{key}"))), None)
        return None
    return f"{where or 'the file'} is {_json_name(value)}; it should be {_type_name(expected)}."


def _object_problem(value: Any, schema: Schema, where: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        return f"{where or 'the file'} is {_json_name(value)}; it should be an object ({{\"key\": value, ...}})."
    for key, expected in schema.items():
        if key in value and (problem := _problem(value[key], expected, f"{where}.{key}" if where else key)):
            return problem
    return None


def _fits(value: Any, expected: Any) -> bool:
    """Whether `value` has the JSON type of `expected` (its items are checked by the caller)."""
    origin = typing.get_origin(expected)
    if origin in (typing.Union, types.UnionType):
        return any(_fits(value, option) for option in typing.get_args(expected))
    if expected is type(None):
        return value is None
    if expected is bool:
        return isinstance(value, bool)
    if expected is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if expected is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if expected is str:
        return isinstance(value, str)
    if origin is list or expected is list:
        return isinstance(value, list)
    if origin is dict or expected is dict:
        return isinstance(value, dict)
    return True  # Any, or a type no config file holds


def _json_name(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"{str(value).lower()} (a boolean)"
    if isinstance(value, (int, float)):
        return "a number"
    return {str: "a string", list: "an array", dict: "an object"}.get(type(value), type(value).__name__)


def _type_name(expected: Any) -> str:
    origin = typing.get_origin(expected)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(option) for option in typing.get_args(expected))
    if origin is list or expected is list:
        return "an array"
    if origin is dict or expected is dict:
        return "an object"
    return {type(None): "null", bool: "true or false", int: "a whole number", float: "a number", str: "a string"}.get(expected, str(expected))
