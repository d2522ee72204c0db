"""JSON schemas from a seeded generator, for the properties structured output must hold on
any schema: objects with required and optional fields, closed or open; arrays with bounds;
enums and consts; strings with lengths and anchored patterns; integers and numbers with
ranges; booleans, nulls; anyOf; nested up to three levels. Every schema is one the grammar
engine takes and the `jsonschema` validator reads the same way (patterns anchored, so a
full match and a search agree)."""

from __future__ import annotations

import random

WORDS = ("id", "name", "n", "ok", "tags", "kind", "size", "items", "x", "y", "note", "meta")
PATTERNS = ("^[a-z]{1,8}$", "^[A-Z][a-z]{0,6}$", "^[0-9]{2,4}$", "^(yes|no|maybe)$", "^[a-f0-9]{4}-[a-f0-9]{2}$")


def schema(rng: random.Random, depth: int = 0) -> dict:
    """One schema; deeper levels lean to scalars, so replies stay short enough to finish."""
    kinds = ["object", "array", "enum", "string", "integer", "number", "boolean", "const", "anyOf", "null"]
    weights = [4, 3, 3, 3, 3, 1, 2, 1, 1, 1] if depth == 0 else [1, 1, 3, 3, 3, 1, 2, 1, 1, 1]
    if depth >= 3:
        weights[:2] = [0, 0]
        weights[8] = 0
    kind = rng.choices(kinds, weights)[0]
    if kind == "object":
        names = rng.sample(WORDS, rng.randint(1, 4 if depth else 5))
        props = {n: schema(rng, depth + 1) for n in names}
        out: dict = {"type": "object", "properties": props,
                     "required": sorted(rng.sample(names, rng.randint(0, len(names))))}
        if rng.random() < 0.7:
            out["additionalProperties"] = False
        return out
    if kind == "array":
        out = {"type": "array", "items": schema(rng, depth + 1)}
        lo = rng.choice([0, 0, 1, 2])
        out["minItems"] = lo
        if rng.random() < 0.8:
            out["maxItems"] = lo + rng.randint(0, 3)
        return out
    if kind == "enum":
        pool = ["red", "green", "blue", "a b", 'q"uote', 0, 1, 42, -7, True, None, "é"]
        return {"enum": rng.sample(pool, rng.randint(1, 5))}
    if kind == "string":
        out = {"type": "string"}
        if rng.random() < 0.4:
            out["pattern"] = rng.choice(PATTERNS)
        else:
            out["minLength"] = rng.choice([0, 1, 3])
            out["maxLength"] = out["minLength"] + rng.choice([0, 2, 8, 16])
        return out
    if kind == "integer":
        lo = rng.choice([-100, 0, 1, 10])
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.choice([0, 9, 99, 10_000])}
    if kind == "number":
        return {"type": "number", "minimum": rng.choice([-1, 0]), "maximum": rng.choice([1, 100])}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "const":
        return {"const": rng.choice(["fixed", 3, False])}
    if kind == "anyOf":
        return {"anyOf": [schema(rng, depth + 1) for _ in range(rng.randint(2, 3))]}
    return {"type": "null"}


def schemas(seed: int, n: int) -> list[dict]:
    rng = random.Random(seed)
    return [schema(rng) for _ in range(n)]
