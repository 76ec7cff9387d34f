"""Triton model repositories read as they are (docs/MIGRATING.md "From Triton: the model repository").

`<model>/config.pbtxt` is parsed against Triton's own model_config.proto (parse.py) and mapped onto
tgw's entries (translate.py): pytorch_libtorch and onnxruntime models, python-backend models as
stages, ensembles as pipelines (ensemble.py); numbered version folders per version_policy
(versions.py); batching, sequences, instance groups and warm-up (scheduling.py); tensors
(tensors.py). Whatever a file asks that tgw does not honour is named field by field: one warning
per model, or a refusal where ignoring it would change answers. The result is plain dicts shaped
like the config's `models:` and `pipelines:` entries; broker/config/repository.py merges them.

This wing sits below config/ (config/ imports it, lazily, only for a `model_repository`) and
imports nothing of the broker but Triton's generated messages.
"""
from .parse import config_from_json, parse_pbtxt
from .translate import Translation, translate_model, translate_repository

__all__ = ["Translation", "config_from_json", "parse_pbtxt", "translate_model", "translate_repository"]
