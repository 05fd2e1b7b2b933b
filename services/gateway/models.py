"""The models the gateway serves, from its workers' registry records (services/model_names.py).

    catalog = ModelCatalog.of([w.info for w in live_workers])
    catalog.names                  # GET /v1/models, in order
    catalog.resolve("/models/m")   # -> "m": the name responses carry, or None when not served

A name maps to its worker's first served name (vLLM answers with the first name too). Served
names win over path aliases where two workers disagree.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable


@dataclass(frozen=True)
class ModelCatalog:
    names: list[str] = field(default_factory=list)
    canonical: dict[str, str] = field(default_factory=dict)     # every accepted name -> first served name
    vocab_sizes: dict[str, int] = field(default_factory=dict)   # first served name -> vocabulary size
    max_model_lens: dict[str, int] = field(default_factory=dict)  # first served name -> prompt + output limit

    @classmethod
    def of(cls, infos: Iterable[dict[str, Any]]) -> "ModelCatalog":
        # records of workers from before served_model_names carry only "model"
        entries = sorted(((_str_list(i.get("served_model_names")) or _str_list([i.get("model")]), i)
                          for i in infos if i.get("model") and _numbers_readable(i)), key=lambda entry: entry[0])
        names: list[str] = []
        canonical: dict[str, str] = {}
        for served, info in entries:
            for name in served:
                canonical.setdefault(name, served[0])
                if name not in names:
                    names.append(name)
        for served, info in entries:
            for alias in _str_list(info.get("model_paths")):
                canonical.setdefault(alias, served[0])
        # workers of one model may differ in max_model_len (one started by hand, a rolling change):
        # the smallest known bound is the one every worker can serve, as the scheduler admits by
        max_lens: dict[str, int] = {}
        for served, info in entries:
            limit = int(info.get("max_model_len") or 0)
            known = max_lens.get(served[0], 0)
            max_lens[served[0]] = min(known, limit) if known and limit else known or limit
        return cls(names, canonical,
                   {served[0]: int(info.get("vocab_size") or 0) for served, info in entries}, max_lens)

    def resolve(self, name: str) -> str | None:
        return self.canonical.get(name)


def _numbers_readable(info: dict[str, Any]) -> bool:
    """Whether the catalog can read the record's numbers: a record with one of the wrong type
    (written by hand, or by another version) is left out, not fatal to the whole discovery."""
    try:
        int(info.get("vocab_size") or 0), int(info.get("max_model_len") or 0)
    except (ValueError, TypeError):
        return False
    return True


def _str_list(value: Any) -> list[str]:
    return [str(v) for v in value if v] if isinstance(value, list) else []
