"""What a constrained generation may produce, before llama.cpp sees it: pure logic, no llama_cpp.

- A JSON Schema is checked for keywords the grammar converter (llama-cpp-python's, see model.py) cannot enforce:
  such a schema is refused with the keyword's name and where it stands, never converted into a grammar that
  silently lets through what the schema forbids. Annotations (description, title, examples, ...) are fine.
- Integer bounds (``minimum``/``maximum``), which that converter ignores, become a grammar of their own here
  (``integer_range``): the decimal numbers in [lo, hi], digit by digit.
- Trigger words of a lazy grammar become one ECMAScript pattern built only from escaped literals, so no text a
  client sends can reach llama.cpp's std::regex (which aborts the process on a pattern it cannot compile).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any


class ConstraintError(ValueError):
    """A grammar, schema or trigger the daemon refuses; the message is the sentence for the client."""


# Keywords the converter turns into grammar rules (or that only annotate).
ENFORCED = {
    "type", "properties", "required", "additionalProperties", "items", "prefixItems", "minItems", "maxItems",
    "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "$defs", "definitions", "pattern", "format",
    "minLength", "maxLength", "minimum", "maximum",
}  # fmt: skip
ANNOTATIONS = {"description", "title", "examples", "default", "$schema", "$id", "$comment", "deprecated", "readOnly",
               "writeOnly", "nullable", "strict", "name"}  # fmt: skip
FORMATS = {"date", "time", "date-time", "uuid", "uuid1", "uuid2", "uuid3", "uuid4", "uuid5"}
TYPES = {"null", "boolean", "number", "integer", "string", "array", "object"}
MAX_DIGITS = 16  # the converter's own integers have at most 16 digits


def parse_schema(text: str) -> dict[str, Any]:
    """The schema in ``text`` (JSON), checked; ConstraintError says what is wrong and where."""
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConstraintError(f"`json_schema` is not valid JSON: {exc}.") from None
    if isinstance(schema, bool) or not isinstance(schema, dict):
        raise ConstraintError('`json_schema` must be a JSON object (a schema such as {"type": "object", ...}).')
    check_schema(schema)
    return schema


def check_schema(schema: Any, where: str = "$") -> None:
    if not isinstance(schema, dict):
        raise ConstraintError(f"{where}: a schema must be an object, not {json.dumps(schema)[:40]}.")
    for key, value in schema.items():
        if key in ANNOTATIONS:
            continue
        if key not in ENFORCED:
            raise ConstraintError(
                f"{where}: the keyword `{key}` is not supported by constrained decoding (it cannot be enforced "
                f"token by token); remove it. Supported: {', '.join(sorted(ENFORCED))}."
            )
        _check_keyword(schema, key, value, where)


def _check_keyword(schema: dict[str, Any], key: str, value: Any, where: str) -> None:
    kinds = schema.get("type")
    kinds = set(kinds) if isinstance(kinds, list) else {kinds}
    if key == "type":
        for kind in kinds:
            if kind not in TYPES:
                raise ConstraintError(f"{where}: unknown type {kind!r}; use one of {', '.join(sorted(TYPES))}.")
    elif key in ("minimum", "maximum"):
        if kinds != {"integer"} or not isinstance(value, int) or isinstance(value, bool):
            raise ConstraintError(
                f"{where}: `{key}` is enforced only on integers with an integer bound (not on numbers); "
                "use type integer or remove it."
            )
    elif key == "format" and value not in FORMATS:
        raise ConstraintError(f"{where}: format {value!r} is not supported; use one of {', '.join(sorted(FORMATS))}.")
    elif key == "pattern" and not (isinstance(value, str) and value.startswith("^") and value.endswith("$")):
        raise ConstraintError(f"{where}: a `pattern` must match the whole string: write it as ^...$.")
    elif key == "enum" and not (isinstance(value, list) and value):
        raise ConstraintError(f"{where}: `enum` must list at least one value (no value can match an empty one).")
    elif key == "$ref" and not (isinstance(value, str) and value.startswith("#/")):
        raise ConstraintError(f"{where}: only local references (#/...) are supported, not {value!r}.")
    elif key in ("properties", "$defs", "definitions"):
        if not isinstance(value, dict):
            raise ConstraintError(f"{where}: `{key}` must be an object of schemas.")
        for name, sub in value.items():
            check_schema(sub, f"{where}.{key}.{name}")
    elif key in ("anyOf", "oneOf", "allOf", "prefixItems"):
        if not isinstance(value, list) or not value:
            raise ConstraintError(f"{where}: `{key}` must be a non-empty list of schemas.")
        for i, sub in enumerate(value):
            check_schema(sub, f"{where}.{key}[{i}]")
    elif key == "items":
        check_schema(value, f"{where}.items")
    elif key == "additionalProperties" and not isinstance(value, bool):
        check_schema(value, f"{where}.additionalProperties")
    elif key == "required" and not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
        raise ConstraintError(f"{where}: `required` must be a list of property names.")
    elif key in ("minItems", "maxItems", "minLength", "maxLength") and not (
        isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 10_000
    ):
        raise ConstraintError(f"{where}: `{key}` must be an integer from 0 to 10000.")


def integer_bounds(schema: dict[str, Any]) -> tuple[int | None, int | None] | None:
    """(minimum, maximum) of an integer schema with bounds, else None."""
    if schema.get("type") != "integer" or not ("minimum" in schema or "maximum" in schema):
        return None
    return schema.get("minimum"), schema.get("maximum")


# ---------------------------------------------------------------------------------------------- integer ranges


@dataclass(frozen=True)
class _Digits:
    """``count`` to ``most`` digits from [low-high] (one character class)."""

    low: str
    high: str
    count: int = 1
    most: int | None = 1  # None: no upper limit

    def gbnf(self) -> str:
        cls = f"[{self.low}]" if self.low == self.high else f"[{self.low}-{self.high}]"
        if self.count == self.most == 1:
            return cls
        if self.count == self.most:
            return f"{cls}{{{self.count}}}"
        return f"{cls}{{{self.count},{'' if self.most is None else self.most}}}"

    def regex(self) -> str:
        cls = f"[{self.low}-{self.high}]"
        return f"{cls}{{{self.count},{'' if self.most is None else self.most}}}"


Sequence = list[_Digits]


def integer_range(lo: int | None, hi: int | None) -> list[Sequence]:
    """The decimal spellings of the integers in [lo, hi] (None: unbounded, up to MAX_DIGITS digits), as
    alternatives of digit sequences; a leading "-" is a _Digits of "-"."""
    if lo is not None and hi is not None and lo > hi:
        raise ConstraintError(f"an integer schema's minimum {lo} is above its maximum {hi}.")
    out: list[Sequence] = []
    if lo is None or lo < 0:  # the negative part: "-" then |n| in [max(1, -hi), -lo]
        top = None if lo is None else -lo
        bottom = 1 if hi is None or hi >= 0 else -hi
        out += [[_Digits("-", "-"), *seq] for seq in _non_negative(bottom, top)]
    if hi is None or hi >= 0:
        out += _non_negative(0 if lo is None or lo < 0 else lo, hi)
    return out


def _non_negative(a: int, b: int | None) -> list[Sequence]:
    """Spellings of the integers in [a, b] (a >= 0; b None: any number of digits up to MAX_DIGITS)."""
    out: list[Sequence] = []
    top_len = MAX_DIGITS if b is None else len(str(b))
    for length in range(len(str(a)), top_len + 1):
        low = max(a, 10 ** (length - 1) if length > 1 else 0)
        high = 10**length - 1 if b is None else min(b, 10**length - 1)
        if b is None and length == len(str(a)) + 1 and low == 10 ** (length - 1):
            out.append([_Digits("1", "9"), _Digits("0", "9", length - 1, MAX_DIGITS - 1)])  # every longer number
            break
        if low <= high:
            out += _same_length(str(low), str(high))
    return out


def _same_length(lo: str, hi: str) -> list[Sequence]:
    """Digit strings of one length from lo to hi (which may have leading zeros past a fixed prefix)."""
    if lo == hi:
        return [[_Digits(c, c) for c in lo]]
    if len(lo) == 1:
        return [[_Digits(lo, hi)]]
    i = next(k for k in range(len(lo)) if lo[k] != hi[k])
    prefix = [_Digits(c, c) for c in lo[:i]]
    lo, hi = lo[i:], hi[i:]
    if len(lo) == 1:
        return [[*prefix, _Digits(lo, hi)]]
    rest = len(lo) - 1
    out: list[Sequence] = []
    start, end = int(lo[0]), int(hi[0])
    if lo[1:] != "0" * rest:
        out += [[_Digits(lo[0], lo[0]), *s] for s in _same_length(lo[1:], "9" * rest)]
        start += 1
    tail_partial = hi[1:] != "9" * rest
    if tail_partial:
        end -= 1
    if start <= end:
        out.append([_Digits(str(start), str(end)), _Digits("0", "9", rest, rest)])
    if tail_partial:
        out += [[_Digits(hi[0], hi[0]), *s] for s in _same_length("0" * rest, hi[1:])]
    return [prefix + s for s in out]


def integer_range_gbnf(lo: int | None, hi: int | None) -> str:
    alternatives = (" ".join(d.gbnf() if d.low != "-" else '"-"' for d in seq) for seq in integer_range(lo, hi))
    return "(" + " | ".join(alternatives) + ")"


def integer_range_regex(lo: int | None, hi: int | None) -> str:
    """The same set as a Python regex (for tests)."""
    alternatives = ("".join("-" if d.low == "-" else d.regex() for d in seq) for seq in integer_range(lo, hi))
    return "(?:" + "|".join(alternatives) + ")"


# ---------------------------------------------------------------------------------------------- lazy triggers

_ECMA_SPECIAL = re.compile(r"[.^$|()*+?\[\]{}\\]")  # llama.cpp's own regex_escape set (common.cpp)


def trigger_pattern(words: list[str]) -> str:
    """One pattern that matches text containing any of ``words``; the grammar then starts at the word (the
    first capture group), as llama.cpp's server does for trigger words. Only escaped literals go in."""
    escaped = "|".join(_ECMA_SPECIAL.sub(lambda m: "\\" + m.group(0), w) for w in words)
    return f"[\\s\\S]*?({escaped})[\\s\\S]*"
