"""JSON merge patch (RFC 7386) and JSON patch (RFC 6902) for the fake API server."""

from __future__ import annotations

import copy
from typing import Any


class PatchError(Exception):
    """A patch document that cannot be applied (the server answers 422)."""


class PatchDecodeError(Exception):
    """A patch document of the wrong shape (the server answers 400)."""


def merge_patch(target: Any, patch: Any) -> Any:
    """Apply an RFC 7386 JSON merge patch; returns a new value."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def _unescape(token: str) -> str:
    return token.replace("~1", "/").replace("~0", "~")


def _pointer(path: Any) -> list[str]:
    if not isinstance(path, str):
        raise PatchDecodeError(f"invalid JSON pointer {path!r}")
    if path == "":
        return []
    if not path.startswith("/"):
        raise PatchError(f'JSON pointer must be empty or start with a "/": {path!r}')
    return [_unescape(t) for t in path[1:].split("/")]


def _index(container: list, token: str, *, allow_end: bool) -> int:
    if token == "-" and allow_end:
        return len(container)
    if not token.isdigit() or (len(token) > 1 and token.startswith("0")):
        raise PatchError(f"invalid array index {token!r}")
    idx = int(token)
    limit = len(container) if allow_end else len(container) - 1
    if idx > limit:
        raise PatchError(f"array index {idx} out of bounds")
    return idx


def _get(doc: Any, tokens: list[str]) -> Any:
    cur = doc
    for tok in tokens:
        if isinstance(cur, dict):
            if tok not in cur:
                raise PatchError(f"doc is missing key: /{'/'.join(tokens)}")
            cur = cur[tok]
        elif isinstance(cur, list):
            cur = cur[_index(cur, tok, allow_end=False)]
        else:
            raise PatchError(f"doc is missing path: /{'/'.join(tokens)}")
    return cur


def _parent(doc: Any, tokens: list[str]) -> tuple[Any, str]:
    if not tokens:
        raise PatchError("the root of the document cannot be the target here")
    return _get(doc, tokens[:-1]), tokens[-1]


def _add(doc: Any, tokens: list[str], value: Any) -> Any:
    if not tokens:
        return value
    parent, tok = _parent(doc, tokens)
    if isinstance(parent, dict):
        parent[tok] = value
    elif isinstance(parent, list):
        parent.insert(_index(parent, tok, allow_end=True), value)
    else:
        raise PatchError(f"add operation does not apply: doc is missing path: /{'/'.join(tokens)}")
    return doc


def _remove(doc: Any, tokens: list[str]) -> Any:
    parent, tok = _parent(doc, tokens)
    if isinstance(parent, dict):
        if tok not in parent:
            raise PatchError(f"remove operation does not apply: doc is missing path: /{'/'.join(tokens)}")
        del parent[tok]
    elif isinstance(parent, list):
        del parent[_index(parent, tok, allow_end=False)]
    else:
        raise PatchError(f"remove operation does not apply: doc is missing path: /{'/'.join(tokens)}")
    return doc


def _json_equal(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_json_equal(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_json_equal(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def json_patch(target: Any, operations: Any) -> Any:
    """Apply an RFC 6902 JSON patch; returns a new value.

    Raises PatchDecodeError when ``operations`` is not a list of operation
    objects (the API server's 400) and PatchError when an operation fails
    (the API server's 422).
    """
    if not isinstance(operations, list):
        kind = "object" if isinstance(operations, dict) else type(operations).__name__
        raise PatchDecodeError(f"json: cannot unmarshal {kind} into Go value of type jsonpatch.Patch")
    doc = copy.deepcopy(target)
    for op in operations:
        if not isinstance(op, dict):
            raise PatchDecodeError("json: cannot unmarshal into Go value of type jsonpatch.Operation")
        name = op.get("op")
        tokens = _pointer(op.get("path"))
        if name == "add":
            if "value" not in op:
                raise PatchError("add operation does not apply: missing value")
            doc = _add(doc, tokens, copy.deepcopy(op["value"]))
        elif name == "remove":
            doc = _remove(doc, tokens)
        elif name == "replace":
            if "value" not in op:
                raise PatchError("replace operation does not apply: missing value")
            if not tokens:
                doc = copy.deepcopy(op["value"])
                continue
            _get(doc, tokens)  # must exist
            doc = _remove(doc, tokens)
            doc = _add(doc, tokens, copy.deepcopy(op["value"]))
        elif name == "move":
            src = _pointer(op.get("from"))
            value = _get(doc, src)
            doc = _remove(doc, src)
            doc = _add(doc, tokens, value)
        elif name == "copy":
            value = copy.deepcopy(_get(doc, _pointer(op.get("from"))))
            doc = _add(doc, tokens, value)
        elif name == "test":
            try:
                current = _get(doc, tokens)
            except PatchError:
                raise PatchError(f"testing value {op.get('path')} failed: test failed") from None
            if not _json_equal(current, op.get("value")):
                raise PatchError(f"testing value {op.get('path')} failed: test failed")
        else:
            raise PatchError(f"Unexpected kind: {name}")
    return doc
