"""A TorchServe archive's handler served as a stage (docs/MIGRATING.md, from TorchServe).

The broker unpacks a .mar into a folder of its own (broker/torchserve/archive.py) and writes there
a one-line entry file whose class subclasses `TorchServeStage`, so the stage's folder
(`context.dir`) is the archive's model_dir. Nothing of TorchServe is copied into tgw: the handler
is loaded by `ts.model_loader.TsModelLoader` (a built-in name such as `text_classifier`, or
`file.py[:function]`: a BaseHandler subclass or a module-level `handle(data, context)`), with the
`Context` and `RequestProcessor` of the installed `ts` package, and is handed each batch as
TorchServe hands it: a list of request dicts ("body" for a raw body, each multipart field by
name) and the headers through `context.get_request_header`.

One request is one row of the `request` bytes input: a MessagePack map made by the broker's
TorchServe face (params: [name, content type, bytes], headers: [name, value]). Each row's answer
is one `response` element: a MessagePack map of the body, the status and the response headers,
encoded as TorchServe's worker encodes them (bytes and str as they are, a tensor by torch.save,
anything else as indented JSON). A failing handler answers every request of its batch with
TorchServe's status and text ("Prediction failed" 503, ...); it never raises, as TorchServe's
worker survives a handler's exception.
"""
from __future__ import annotations

import io
import json
import logging
import os
import sys
import uuid

import msgspec
import torch

from .stage import StageBatch, StageContext

log = logging.getLogger("tgw.worker")

_decode = msgspec.msgpack.Decoder()
_encode = msgspec.msgpack.Encoder()


class TorchServeStage:
    """The stage behind one TorchServe archive version."""

    def setup(self, context: StageContext) -> None:
        try:
            from ts.context import RequestProcessor
            from ts.metrics.metric_cache_yaml_impl import MetricsCacheYamlImpl
            from ts.model_loader import TsModelLoader
        except ImportError as exc:
            raise RuntimeError(f"serving a TorchServe archive needs the `ts` package (pip install "
                               f"'tgw[torchserve]'): {exc}") from None
        import ts
        self.request_processor = RequestProcessor
        model_dir = context.dir
        with open(os.path.join(model_dir, "MAR-INF", "MANIFEST.json")) as f:
            manifest = json.load(f)
        options = context.options.get("torchserve", {})
        handler = manifest["model"]["handler"]
        if model_dir in sys.path:
            sys.path.remove(model_dir)
        sys.path.insert(0, model_dir)   # as TorchServe's worker: the handler imports its siblings
        # a worker may hold several archives, and TorchServe's examples all name their files alike
        # (handler.py, model.py): this archive's own are imported afresh, the others keep theirs
        for named in (handler.split(":", 1)[0], manifest["model"].get("modelFile") or ""):
            if named.endswith(".py"):
                sys.modules.pop(os.path.basename(named)[:-3], None)
        os.environ.setdefault("TS_MODEL_DIR", model_dir)
        # ts logs a [METRICS] line per batch (TorchServe's frontend parses them from the worker's
        # stdout); here each would cross into the broker's log: tgw's own metrics count the same
        logging.getLogger("ts.metrics").setLevel(logging.WARNING)
        gpu = context.device.index if context.device.type == "cuda" else None
        metrics_yaml = os.path.join(os.path.dirname(ts.__file__), "configs", "metrics.yaml")
        metrics = MetricsCacheYamlImpl(config_file_path=metrics_yaml)
        metrics.initialize_cache()
        metrics.model_name = options.get("model_name") or manifest["model"]["modelName"]
        name = options.get("model_name") or manifest["model"]["modelName"]
        batch_size = int(options.get("batch_size", 1))
        cwd = os.getcwd()
        os.chdir(model_dir)   # TorchServe's worker runs in the model's folder: handlers open files relative to it
        try:
            self.service = TsModelLoader().load(name, model_dir, handler, gpu, batch_size,
                                                manifest["model"].get("envelope"), True, metrics)
        finally:
            os.chdir(cwd)
        self.context = self.service.context
        self.name = name

    def __call__(self, batch: StageBatch) -> dict:
        requests = [_decode.decode(raw) for raw in batch["request"]]
        return {"response": [_encode.encode(answer) for answer in self.run(requests)]}

    def run(self, requests: list[dict]) -> list[dict]:
        """TorchServe's Service.predict, answered as plain maps instead of its socket frame."""
        processors, inputs, ids = [], [], {}
        for idx, req in enumerate(requests):
            headers, data = {}, {}
            for name, content_type, value in req["params"]:
                data[name] = _value(content_type or "", value)
                headers[name] = {"content-type": content_type}
            headers.update(dict(req["headers"]))
            processors.append(self.request_processor(headers))
            inputs.append(data)
            ids[idx] = req.get("id") or str(uuid.uuid4())
        context = self.context
        context.request_ids, context.request_processor = ids, processors
        if context.metrics is not None:
            context.metrics.request_ids = ids
        try:
            ret = self.service._entry_point(inputs, context)
        except MemoryError:
            log.error("%s: system out of memory", self.name, exc_info=True)
            return _failed(len(requests), "Out of resources", 507)
        except Exception as exc:  # TorchServe's worker answers and serves on
            from ts.utils.util import PredictionException
            if isinstance(exc, PredictionException):
                log.error("%s: prediction error", self.name, exc_info=True)
                return _failed(len(requests), exc.message, exc.error_code)
            if "CUDA" in str(exc):
                log.error("%s: CUDA out of memory", self.name, exc_info=True)
                return _failed(len(requests), "Out of resources", 507)
            log.warning("%s: invoking custom service failed.", self.name, exc_info=True)
            return _failed(len(requests), "Prediction failed", 503)
        if not isinstance(ret, list):
            log.warning("model: %s, Invalid return type: %s.", self.name, type(ret))
            return _failed(len(requests), "Invalid model predict output", 503)
        if len(ret) != len(inputs):
            log.warning("model: %s, number of batch response mismatched, expect: %d, got: %d.", self.name,
                        len(inputs), len(ret))
            return _failed(len(requests), "number of batch response mismatched", 503)
        answers = []
        for idx, value in enumerate(ret):
            code, phrase = context.get_response_status(idx)
            try:
                body = _encoded(value)
            except TypeError:
                log.warning("%s: unable to serialize model output.", self.name, exc_info=True)
                return _failed(len(requests), "Unsupported model output data type.", 503)
            answers.append({"body": body, "status": code or 200, "phrase": phrase or "",
                            "headers": dict(context.get_response_headers(idx))})
        return answers


def _value(content_type: str, value: bytes):
    """A parameter as TorchServe's worker hands it (otf_message_handler._retrieve_input_data)."""
    if os.environ.get("TS_DECODE_INPUT_REQUEST", "true") != "true":
        return value
    try:
        if content_type == "application/json":
            return json.loads(value.decode("utf-8"))
        if content_type.startswith("text"):
            return value.decode("utf-8")
    except Exception:  # as TorchServe: the encoded payload is forwarded
        log.warning("failed decoding of input data (%s): forwarding the encoded payload", content_type)
    return value


def _encoded(value) -> bytes:
    """One response body as TorchServe's worker encodes it (create_predict_response)."""
    if isinstance(value, (bytes, bytearray)):
        return bytes(value)
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, torch.Tensor):
        buf = io.BytesIO()
        torch.save(value, buf)
        return buf.getvalue()
    return json.dumps(value, indent=2).encode("utf-8")   # TypeError: not serializable


def _failed(n: int, message: str, code: int) -> list[dict]:
    return [{"error": message, "status": code}] * n
