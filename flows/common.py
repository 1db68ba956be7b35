"""Per-process helpers shared by the flows: settings loaded once, one DataStore per data root."""

from __future__ import annotations

from clawrl import runtime
from clawrl.config import Settings, load_settings


def load_flow_settings(config_path: str | None) -> Settings:
    return runtime.get_or_create(f"settings:{config_path}", lambda: load_settings(config_path))


def data_store(settings: Settings):
    from storage.writer import DataStore

    return runtime.get_or_create(f"store:{settings.storage.data_root}", lambda: DataStore(settings.storage.data_root))
