"""The base of every section of the configuration's schema: strict, frozen, no unknown key.

Its own module because every part of the schema builds on it: schema.py, the models' part
(schema_models.py) and pipelines.py, which schema.py imports.
"""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Strict(BaseModel):
    # strict: YAML already gives native types, so "32" or true for an int is a mistake to report
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)
