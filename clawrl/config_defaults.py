"""``clawrl config show --defaults``: the defaults as TOML, each key with the first sentence of its
description (two screens); with ``--full`` each key under its whole description (conf/default.toml is
that output)."""

from __future__ import annotations

import json
import re
import textwrap

from pydantic_core import to_jsonable_python

from clawrl.config import Settings

_HEADER = ("clawrl's defaults{what}. Overlay only the keys you change with `--config FILE`, then env "
           "CLAWRL__SECTION__KEY=value. Secrets never live in a file: [server] and [provider] name the environment "
           "variables that hold them.")
_BRIEF = ", a line a key (`clawrl config show --defaults`; what each trades off: `--full`, conf/default.toml)"
_FULL = (", each key under its description: `clawrl config show --defaults --full` prints this file "
         "(tests/test_config.py keeps the two equal)")
_SENTENCE_END = re.compile(r"(?<=\.)\s+(?=[A-Z'`(])")  # "e.g. https://..." does not end one
WIDTH = 98


def _comment(text: str) -> list[str]:
    return textwrap.wrap(" ".join(text.split()), WIDTH, initial_indent="# ", subsequent_indent="# ")


def _assignment(key: str, value: object) -> str:
    return f"# {key} is unset" if value is None else f"{key} = {json.dumps(value)}"


def dump_defaults(full: bool = False) -> str:
    """The defaults as TOML: each key with the first sentence of its description on its line, or
    (``full``) under its whole description, each section under its own."""
    out = [*_comment(_HEADER.format(what=_FULL if full else _BRIEF)), ""]
    for section, field in Settings.model_fields.items():
        out += [*(_comment(field.annotation.__doc__ or "") if full else []), f"[{section}]"]
        for key, f in field.annotation.model_fields.items():
            line = _assignment(key, to_jsonable_python(f.default))  # as written: "~/.clawrl", not this home
            if full:
                out += [*_comment(f.description or ""), line]
            else:
                first = _SENTENCE_END.split(" ".join((f.description or "").split()), maxsplit=1)[0]
                out += textwrap.wrap(f"{line}  # {first}", WIDTH + 2, subsequent_indent="#   ")
        out.append("")
    return "\n".join(out)
