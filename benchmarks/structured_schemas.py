"""Fifty JSON schemas with a prompt each, for ``make bench-structured`` and the structured-output
tests: nested objects, arrays, enums, ``anyOf``, string formats and patterns, required and optional
keys, numbers with bounds. Strings and arrays are bounded (``maxLength``, ``maxItems``) so every
output can end within the benchmark's ``max_tokens``."""

from __future__ import annotations

S = {"type": "string", "maxLength": 32}
I = {"type": "integer"}
N = {"type": "number"}
B = {"type": "boolean"}


def obj(props: dict, required: list[str] | None = None, **extra) -> dict:
    """An object schema with ``props``, all required unless ``required`` says which."""
    return {"type": "object", "properties": props, "required": list(props) if required is None else required,
            "additionalProperties": False, **extra}


def arr(items: dict, lo: int = 1, hi: int = 4) -> dict:
    return {"type": "array", "items": items, "minItems": lo, "maxItems": hi}


def enum(*values) -> dict:
    return {"enum": list(values)}


ADDRESS = obj({"street": S, "city": S, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}})
PERSON = obj({"name": S, "age": {"type": "integer", "minimum": 0, "maximum": 130}})

#: (prompt, schema) pairs.
SCHEMAS: list[tuple[str, dict]] = [
    ("Describe a person as JSON.", PERSON),
    ("Give a city and its country as JSON.", obj({"city": S, "country": S})),
    ("A book as JSON.", obj({"title": S, "author": S, "year": I})),
    ("A product with a price as JSON.", obj({"name": S, "price": {"type": "number", "minimum": 0}})),
    ("Is water wet? Answer as JSON.", obj({"answer": B, "reason": S})),
    ("A color as JSON.", obj({"color": enum("red", "green", "blue", "yellow")})),
    ("The weather today as JSON.", obj({"temperature_c": N, "sky": enum("sunny", "cloudy", "rainy")})),
    ("A user account as JSON.", obj({"username": {"type": "string", "pattern": "^[a-z][a-z0-9_]{2,15}$"},
                                     "email": {"type": "string", "format": "email", "maxLength": 40}})),
    ("An event with a date as JSON.", obj({"event": S, "date": {"type": "string", "format": "date"}})),
    ("A meeting time as JSON.", obj({"title": S, "start": {"type": "string", "format": "date-time"}})),
    ("A website as JSON.", obj({"name": S, "url": {"type": "string", "format": "uri", "maxLength": 60}})),
    ("A shopping list as JSON.", obj({"items": arr(S, 1, 5)})),
    ("Three numbers as JSON.", obj({"numbers": arr(I, 3, 3)})),
    ("A person with an address as JSON.", obj({"name": S, "address": ADDRESS})),
    ("A team of people as JSON.", obj({"team": S, "members": arr(PERSON, 1, 3)})),
    ("A recipe as JSON.", obj({"dish": S, "ingredients": arr(S, 1, 5), "minutes": {"type": "integer", "minimum": 1}})),
    ("A movie as JSON.", obj({"title": S, "genre": enum("drama", "comedy", "action", "horror"),
                              "rating": {"type": "number", "minimum": 0, "maximum": 10}})),
    ("A pet as JSON.", obj({"species": enum("cat", "dog", "fish"), "name": S, "age": I}, ["species", "name"])),
    ("A point in 2D as JSON.", obj({"x": N, "y": N})),
    ("A rectangle as JSON.", obj({"top_left": obj({"x": I, "y": I}), "bottom_right": obj({"x": I, "y": I})})),
    ("An HTTP response as JSON.", obj({"status": {"type": "integer", "minimum": 100, "maximum": 599},
                                       "ok": B, "message": S})),
    ("A company as JSON.", obj({"name": S, "employees": {"type": "integer", "minimum": 1},
                                "public": B, "ceo": PERSON})),
    ("A car as JSON.", obj({"make": S, "model": S, "year": {"type": "integer", "minimum": 1900, "maximum": 2030}})),
    ("A phone contact as JSON.", obj({"name": S, "phone": {"type": "string", "pattern": "^\\+?[0-9]{7,12}$"}})),
    ("A tag cloud as JSON.", obj({"tags": arr({"type": "string", "maxLength": 12}, 1, 4)})),
    ("A yes/no survey answer as JSON.", obj({"question": S, "answer": enum("yes", "no", "unsure")})),
    ("An animal, either a bird or a fish, as JSON.",
     {"anyOf": [obj({"kind": enum("bird"), "wingspan_cm": I}), obj({"kind": enum("fish"), "fins": I})]}),
    ("A measurement as JSON.", obj({"value": N, "unit": enum("m", "kg", "s")})),
    ("A grade as JSON.", obj({"student": S, "grade": {"type": "string", "pattern": "^[A-F]$"}})),
    ("A planet as JSON.", obj({"name": S, "moons": {"type": "integer", "minimum": 0}, "has_rings": B})),
    ("A list of people as JSON.", arr(PERSON, 1, 3)),
    ("A todo item as JSON.", obj({"task": S, "done": B, "priority": enum("low", "medium", "high")})),
    ("A song as JSON.", obj({"title": S, "artist": S, "seconds": {"type": "integer", "minimum": 1}})),
    ("A bank transfer as JSON.", obj({"from": S, "to": S, "amount": {"type": "number", "exclusiveMinimum": 0},
                                      "currency": enum("EUR", "USD", "GBP")})),
    ("A key-value setting as JSON.", obj({"key": S, "value": {"anyOf": [S, I, B]}})),
    ("A version number as JSON.", obj({"version": {"type": "string", "pattern": "^[0-9]+\\.[0-9]+\\.[0-9]+$"}})),
    ("A flight as JSON.", obj({"from": {"type": "string", "pattern": "^[A-Z]{3}$"},
                               "to": {"type": "string", "pattern": "^[A-Z]{3}$"}, "date": {"type": "string",
                                                                                          "format": "date"}})),
    ("A country with its languages as JSON.", obj({"country": S, "languages": arr(S, 1, 3)})),
    ("A matrix of numbers as JSON.", obj({"rows": arr(arr(I, 2, 2), 2, 2)})),
    ("A library with books as JSON.", obj({"library": S, "books": arr(obj({"title": S, "year": I}), 1, 3)})),
    ("A sentiment label as JSON.", obj({"text": S, "sentiment": enum("positive", "negative", "neutral"),
                                        "confidence": {"type": "number", "minimum": 0, "maximum": 1}})),
    ("A person with an optional nickname as JSON.", obj({"name": S, "nickname": S}, ["name"])),
    ("An order with lines as JSON.", obj({"order_id": I, "lines": arr(obj({"sku": S, "qty": {
        "type": "integer", "minimum": 1}}), 1, 3)})),
    ("A geographic location as JSON.", obj({"lat": {"type": "number", "minimum": -90, "maximum": 90},
                                            "lon": {"type": "number", "minimum": -180, "maximum": 180}})),
    ("A null-or-string field as JSON.", obj({"comment": {"anyOf": [S, {"type": "null"}]}})),
    ("A nested config as JSON.", obj({"server": obj({"host": S, "port": {"type": "integer", "minimum": 1,
                                                                         "maximum": 65535}}), "debug": B})),
    ("A chess move as JSON.", obj({"piece": enum("king", "queen", "rook", "bishop", "knight", "pawn"),
                                   "square": {"type": "string", "pattern": "^[a-h][1-8]$"}})),
    ("A temperature reading as JSON.", obj({"celsius": N, "fahrenheit": N})),
    ("A poem as JSON.", obj({"title": S, "lines": arr({"type": "string", "maxLength": 60}, 2, 4)})),
    ("A quiz question as JSON.", obj({"question": S, "options": arr(S, 2, 4),
                                      "answer_index": {"type": "integer", "minimum": 0, "maximum": 3}})),
]

assert len(SCHEMAS) == 50
