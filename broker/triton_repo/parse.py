"""config.pbtxt (protobuf text format) and its JSON form read into Triton's ModelConfig message,
with errors that name the file and the line."""
from __future__ import annotations

import json
import os

from google.protobuf import json_format, text_format

from tgw.broker.faces.grpc.proto.model_config_pb2 import ModelConfig

CONFIG_FILE = "config.pbtxt"


class ConfigFileError(ValueError):
    """A config.pbtxt that cannot be read or parsed (the message names the file)."""


def parse_pbtxt(text: str) -> ModelConfig:
    """A config.pbtxt's text as Triton's ModelConfig; ValueError (with text_format's line and
    column) when it is not valid text format for that message."""
    try:
        return text_format.Parse(text, ModelConfig())
    except text_format.ParseError as exc:
        raise ValueError(f"not a valid model config: {exc}") from None


def config_from_json(text_or_dict: str | dict) -> ModelConfig:
    """Triton's JSON form of a model config (what its config document answers, what a repository
    load's `config` parameter carries) as a ModelConfig; ValueError naming what is wrong."""
    try:
        data = json.loads(text_or_dict) if isinstance(text_or_dict, str) else text_or_dict
        return json_format.ParseDict(data, ModelConfig())
    except (ValueError, json_format.ParseError) as exc:
        raise ValueError(f"not a valid model config: {exc}") from None


def as_dict(config: ModelConfig) -> dict:
    """The config as Triton's JSON form, field names as in the .proto (what a Python-backend model
    is given as args["model_config"])."""
    return json_format.MessageToDict(config, preserving_proto_field_name=True)


def read_config(model_dir: str) -> ModelConfig:
    """`model_dir`/config.pbtxt parsed. Triton's auto-complete (a config inferred from the model
    file) is not done: a missing file is an error that names it."""
    path = os.path.join(model_dir, CONFIG_FILE)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise ConfigFileError(f"{path} not found: tgw does not auto-complete a config from the model file "
                              "(Triton's --strict-model-config=false); write config.pbtxt") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigFileError(f"{path} cannot be read: {exc}") from None
    try:
        return parse_pbtxt(text)
    except ValueError as exc:
        raise ConfigFileError(f"{path}: {exc}") from None
