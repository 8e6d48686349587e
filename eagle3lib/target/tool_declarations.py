"""Tool declarations in the TypeScript style that Kimi-K2.5's chat template prefers to JSON (`tools_ts_str`).

OpenAI-style tools ({"type": "function", "function": {name, description, parameters}}) become

    # Tools

    ## functions
    namespace functions {
    // description
    type name = (_: {
      // a property's description and constraints
      prop: type,
      optional?: type
    }) => any;
    }

Types: string, number (integer too), boolean, null, Array<T>, nested objects as blocks, enums and anyOf / type
lists as unions, `$ref`s to `$defs` as named interfaces declared before the function; an unknown type keeps its
name. Checked against the golden outputs of Kimi's own encoder (tests/e2e/test_kimi.py).
"""

from __future__ import annotations

import json

INDENT = "  "
SCALARS = {"string": "string", "integer": "number", "number": "number", "boolean": "boolean", "null": "null"}
# constraints written as comments above a property, in this order
CONSTRAINTS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "minLength", "maxLength", "pattern",
               "format", "minItems", "maxItems", "default")  # fmt: skip


def typescript_declaration(tools: list[dict]) -> str:
    """The `tools_ts_str` of a list of OpenAI-style tools."""
    lines = ["# Tools", "", "## functions", "namespace functions {"]
    for tool in tools:
        fn = tool.get("function", tool)
        if "name" not in fn:
            raise ValueError(f"Expected a tool with a function name, found {json.dumps(tool)[:200]}")
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        for name, schema in (params.get("$defs") or params.get("definitions") or {}).items():
            lines.append(f"interface {name} {_object(schema, 0)}")
        lines += _comment(fn.get("description"), 0)
        lines.append(f"type {fn['name']} = (_: {_object(params, 0)}) => any;")
    lines.append("}")
    return "\n".join(lines) + "\n"


def _comment(text, depth: int) -> list[str]:
    return [f"{INDENT * depth}// {line}" for line in str(text).split("\n")] if text else []


def _object(schema: dict, depth: int) -> str:
    """An object schema as a `{ ... }` block whose closing brace sits at `depth`."""
    props = schema.get("properties") or {}
    if not props:
        return "{}"
    required = set(schema.get("required") or [])
    inner = INDENT * (depth + 1)
    entries = []
    for name, prop in props.items():
        lines = _comment(prop.get("description"), depth + 1)
        lines += [f"{inner}// {k}: {_value(prop[k])}" for k in CONSTRAINTS if k in prop]
        optional = "" if name in required else "?"
        lines.append(f"{inner}{name}{optional}: {_type(prop, depth + 1)}")
        entries.append("\n".join(lines))
    return "{\n" + ",\n".join(entries) + "\n" + INDENT * depth + "}"


def _type(schema: dict, depth: int) -> str:
    if "$ref" in schema:
        return schema["$ref"].rsplit("/", 1)[-1]
    if "enum" in schema:
        return " | ".join(json.dumps(v, ensure_ascii=False) for v in schema["enum"])
    if "const" in schema:
        return json.dumps(schema["const"], ensure_ascii=False)
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return " | ".join(_type(s, depth) for s in schema[key])
    kind = schema.get("type")
    if isinstance(kind, list):
        return " | ".join(_type({**schema, "type": k}, depth) for k in kind)
    if kind == "array":
        return f"Array<{_type(schema.get('items') or {}, depth)}>"
    if kind == "object" or "properties" in schema:
        return _object(schema, depth) if schema.get("properties") else "object"
    if kind is None:
        return "any"
    return SCALARS.get(kind, kind)


def _value(v) -> str:
    return v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)
