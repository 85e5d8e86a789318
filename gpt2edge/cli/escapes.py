"""llama.cpp's `-e` / `--escape`: backslash escapes in -p and --stop (string_process_escapes in its common/).

\\n \\r \\t \\' \\" \\\\ and \\xHH (two hex digits) are replaced; any other backslash is kept as typed, so a
Windows path or a regex in a prompt survives.
"""

from __future__ import annotations

_SIMPLE = {"n": "\n", "r": "\r", "t": "\t", "'": "'", '"': '"', "\\": "\\"}
_HEX = set("0123456789abcdefABCDEF")


def process_escapes(text: str) -> str:
    out: list[str] = []
    i = 0
    while i < len(text):
        c = text[i]
        if c != "\\" or i + 1 == len(text):
            out.append(c)
            i += 1
            continue
        nxt = text[i + 1]
        if nxt in _SIMPLE:
            out.append(_SIMPLE[nxt])
            i += 2
        elif nxt == "x" and len(text) >= i + 4 and set(text[i + 2 : i + 4]) <= _HEX:
            out.append(chr(int(text[i + 2 : i + 4], 16)))
            i += 4
        else:  # unknown escape: kept as typed
            out.append(c)
            i += 1
    return "".join(out)
