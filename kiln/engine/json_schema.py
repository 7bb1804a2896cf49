"""JSON Schemas as the shapes ``kiln.engine.structured``'s automaton follows.

``compile_schema`` turns a JSON Schema into a tree of ``Shape``s. What it
enforces is structure: ``type`` (one or a list), ``properties`` with
``required`` and ``additionalProperties``, ``items`` with ``minItems`` and
``maxItems``, ``enum``, ``const``, ``anyOf``/``oneOf`` (as alternatives),
``allOf`` of one schema, and ``$ref`` into ``$defs``/``definitions`` (recursive
schemas too), which covers what pydantic writes for a model. An object with
``properties`` takes no other keys unless ``additionalProperties`` says so (as
OpenAI's strict mode and vLLM's grammar do), and each key at most once, in any
order. Annotations and checks of values are not enforced (``format``,
``pattern``, ``minLength``, ``minimum``, ...); keywords whose meaning kiln
cannot keep (``not``, ``if``, ``patternProperties``, ...) are a ValueError
naming them, rather than output that ignores them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ANY", "AnyValue", "Array", "Literal", "Number", "Object", "Shape", "String", "Union", "any_object",
           "compile_schema", "resolve"]

_REFUSED = ("not", "if", "then", "else", "patternProperties", "propertyNames", "dependentRequired",
            "dependentSchemas", "prefixItems", "contains", "uniqueItems", "unevaluatedProperties", "unevaluatedItems")
_TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")


class Shape:
    """What a JSON value may be."""


@dataclass(eq=False)
class AnyValue(Shape):
    pass


ANY = AnyValue()


@dataclass(eq=False)
class Object(Shape):
    properties: dict[str, Shape]
    required: frozenset[str] = frozenset()
    extra: Shape | None = None  # the shape of other keys' values; None: no other keys
    keys: dict[bytes, str] = field(init=False)  # each property's name as JSON writes it between the quotes

    def __post_init__(self) -> None:
        self.keys = {json.dumps(name, ensure_ascii=False)[1:-1].encode("utf-8"): name for name in self.properties}

    def value(self, key: str) -> Shape | None:
        return self.properties.get(key, self.extra)


@dataclass(eq=False)
class Array(Shape):
    items: Shape
    min_items: int = 0
    max_items: int | None = None


@dataclass(eq=False)
class String(Shape):
    enum: frozenset[bytes] | None = None  # the allowed strings as JSON writes them between the quotes


@dataclass(eq=False)
class Number(Shape):
    integer: bool = False


@dataclass(eq=False)
class Literal(Shape):
    texts: tuple[bytes, ...]  # true, false, null, or enum/const numbers as JSON writes them


@dataclass(eq=False)
class Union(Shape):
    options: tuple[Shape, ...]


@dataclass(eq=False)
class _Ref(Shape):
    """A ``$ref``, resolved when first followed (schemas may refer to themselves)."""

    target: Shape | None = None


def any_object() -> Object:
    """``response_format: json_object``: an object with any keys and values."""
    return Object({}, extra=ANY)


def compile_schema(schema: Any) -> Shape:
    """The shape of ``schema``; ValueError naming the keyword and its path."""
    return _Compiler(schema).shape(schema, "schema")


def resolve(shape: Shape) -> Shape:
    """The shape a ``$ref`` stands for (compile_schema refuses references that lead nowhere but to themselves)."""
    while isinstance(shape, _Ref):
        shape = shape.target  # type: ignore[assignment]
    return shape


class _Compiler:
    def __init__(self, root: Any) -> None:
        self.root = root
        self.refs: dict[str, _Ref] = {}

    def shape(self, schema: Any, path: str) -> Shape:
        if schema is True or schema == {}:
            return ANY
        if not isinstance(schema, dict):
            raise ValueError(f"{path} must be a JSON Schema object, got {schema!r:.80}")
        for key in _REFUSED:
            if key in schema:
                raise ValueError(f"{path}.{key} is not supported (kiln keeps types, properties, required, items, "
                                 "enum, const, anyOf/oneOf and $ref)")
        if "$ref" in schema:
            return self._ref(schema["$ref"], path)
        if "const" in schema:
            return self._enum([schema["const"]], f"{path}.const")
        if "enum" in schema:
            if not isinstance(schema["enum"], list) or not schema["enum"]:
                raise ValueError(f"{path}.enum must be a non-empty list")
            return self._enum(schema["enum"], f"{path}.enum")
        for key in ("anyOf", "oneOf", "allOf"):
            if key in schema:
                return self._combined(schema, key, path)
        kinds = schema.get("type")
        if kinds is None:
            kinds = "object" if "properties" in schema else "array" if "items" in schema else None
        if kinds is None:
            return ANY
        kinds = [kinds] if isinstance(kinds, str) else kinds
        if not isinstance(kinds, list) or not kinds or any(k not in _TYPES for k in kinds):
            raise ValueError(f"{path}.type must be one of {list(_TYPES)} or a list of them, got {schema['type']!r}")
        shapes = [self._typed(k, schema, path) for k in dict.fromkeys(kinds)]
        return shapes[0] if len(shapes) == 1 else Union(tuple(shapes))

    def _typed(self, kind: str, schema: dict[str, Any], path: str) -> Shape:
        if kind == "object":
            return self._object(schema, path)
        if kind == "array":
            return self._array(schema, path)
        if kind == "string":
            return String()
        if kind in ("number", "integer"):
            return Number(integer=kind == "integer")
        return Literal((b"true", b"false") if kind == "boolean" else (b"null",))

    def _object(self, schema: dict[str, Any], path: str) -> Object:
        props = schema.get("properties", {})
        if not isinstance(props, dict):
            raise ValueError(f"{path}.properties must be an object")
        required = schema.get("required", [])
        if not isinstance(required, list) or any(r not in props for r in required):
            raise ValueError(f"{path}.required must list names of {path}.properties, got {required!r:.80}")
        extra_schema = schema.get("additionalProperties", not props)  # closed when it declares properties
        extra = None if extra_schema is False else self.shape(extra_schema, f"{path}.additionalProperties")
        shapes = {name: self.shape(s, f"{path}.properties.{name}") for name, s in props.items()}
        return Object(shapes, frozenset(required), extra)

    def _array(self, schema: dict[str, Any], path: str) -> Array:
        low, high = schema.get("minItems", 0), schema.get("maxItems")
        if not isinstance(low, int) or low < 0 or (high is not None and (not isinstance(high, int) or high < low)):
            raise ValueError(f"{path}: minItems/maxItems must be integers with 0 <= minItems <= maxItems")
        return Array(self.shape(schema.get("items", True), f"{path}.items"), low, high)

    def _enum(self, values: list[Any], path: str) -> Shape:
        strings = frozenset(json.dumps(v, ensure_ascii=False)[1:-1].encode("utf-8") for v in values
                            if isinstance(v, str))
        others = []
        for v in values:
            if isinstance(v, (dict, list)):
                raise ValueError(f"{path}: objects and arrays as enum or const values are not supported")
            if not isinstance(v, str):
                others.append(json.dumps(v).encode())
        shapes: list[Shape] = ([String(strings)] if strings else []) + ([Literal(tuple(others))] if others else [])
        return shapes[0] if len(shapes) == 1 else Union(tuple(shapes))

    def _combined(self, schema: dict[str, Any], key: str, path: str) -> Shape:
        options = schema[key]
        if not isinstance(options, list) or not options:
            raise ValueError(f"{path}.{key} must be a non-empty list of schemas")
        if key == "allOf" and len(options) != 1:
            raise ValueError(f"{path}.allOf of more than one schema is not supported")
        shapes = tuple(self.shape(s, f"{path}.{key}[{i}]") for i, s in enumerate(options))
        return shapes[0] if len(shapes) == 1 else Union(shapes)

    def _ref(self, ref: Any, path: str) -> Shape:
        if ref in self.refs:
            return self.refs[ref]
        if not isinstance(ref, str) or not ref.startswith("#"):
            raise ValueError(f"{path}.$ref must point into the schema ('#/$defs/...'), got {ref!r}")
        target: Any = self.root
        for part in [p for p in ref[1:].split("/") if p]:
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(target, dict) or part not in target:
                raise ValueError(f"{path}.$ref {ref!r} points at nothing")
            target = target[part]
        node = self.refs[ref] = _Ref()
        node.target = self.shape(target, ref)
        seen: set[int] = set()
        step: Shape | None = node
        while isinstance(step, _Ref):
            if id(step) in seen or step.target is None:
                raise ValueError(f"{path}.$ref {ref!r} refers only to itself")
            seen.add(id(step))
            step = step.target
        return node
