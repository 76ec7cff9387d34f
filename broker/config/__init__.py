"""The YAML configuration: schema, loading and validation, model roots, arena sizing.

The rest of the broker imports the schema and the loader from here (load.py's names)."""
from .load import *  # noqa: F401,F403
from .load import __all__  # noqa: F401
