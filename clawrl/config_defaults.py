"""``clawrl config show --defaults``: the defaults as TOML, each key under its description (conf/default.toml
is this output)."""

from __future__ import annotations

import json
import textwrap

from pydantic_core import to_jsonable_python

from clawrl.config import Settings

_DEFAULTS_HEADER = """\
# clawrl's defaults, each key under its description: `clawrl config show --defaults` prints this file
# (tests/test_config.py keeps the two equal). Overlay only the keys you change with `--config FILE`,
# then env CLAWRL__SECTION__KEY=value. Secrets never live in a file: [server] and [provider] name the
# environment variables that hold them.
"""


def _comment(text: str) -> list[str]:
    return textwrap.wrap(" ".join(text.split()), 98, initial_indent="# ", subsequent_indent="# ")


def dump_defaults() -> str:
    """The defaults as TOML, each key under its description (``clawrl config show --defaults``, which
    conf/default.toml is)."""
    out = [_DEFAULTS_HEADER]
    for section, field in Settings.model_fields.items():
        out += [*_comment(field.annotation.__doc__ or ""), f"[{section}]"]
        for key, f in field.annotation.model_fields.items():
            value = to_jsonable_python(f.default)  # as written: "~/.clawrl", not this machine's home
            out += _comment(f.description or "")
            out.append(f"# {key} is unset" if value is None else f"{key} = {json.dumps(value)}")
        out.append("")
    return "\n".join(out)
