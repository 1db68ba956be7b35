"""The names of a namespace's adapter versions (clawrl/records.py)."""

from __future__ import annotations

import pytest

from clawrl.records import adapter_name, adapter_number, parse_adapter_name


def test_a_version_written_as_n_or_its_name_is_that_namespace_s_and_no_other():
    ns = "key-0123456789abcdef"
    assert adapter_number(ns, "3") == adapter_number(ns, f"{ns}@v3") == parse_adapter_name(adapter_name(ns, 3))[1] == 3
    for bad in ("key-fedcba9876543210@v3", "two", "v3", "", f"{ns}@3"):
        with pytest.raises(ValueError):
            adapter_number(ns, bad)
