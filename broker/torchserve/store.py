"""The model store: a folder of TorchServe archives, the ones served at start (TorchServe's
`--models`), the archives named by a registration's `url`, and the catalog of what is served
(model -> version -> its archive and registration), which the TorchServe face alone writes.

An archive is named by its file name in the store (`x.mar`, `x.tar.gz`, or a `no-archive`
folder); tgw downloads nothing, so a url with a scheme is refused.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from tgw.broker.config.load import Config, ConfigError, ModelDecl, TorchServeDecl, with_models

from .archive import Archive, ArchiveError, Registration, model_decl, unpack

log = logging.getLogger("tgw.broker")
SUFFIXES = (".mar", ".tar.gz", ".tgz", ".zip")
UNPACKED = ".tgw-unpacked"


class ModelStore:
    def __init__(self, folder: str, unpack_dir: str | None = None):
        self.folder = os.path.realpath(folder)
        self.unpack_dir = os.path.realpath(unpack_dir or os.path.join(self.folder, UNPACKED))

    def names(self) -> list[str]:
        """Every archive in the store, by file name, sorted."""
        try:
            found = os.listdir(self.folder)
        except OSError as exc:
            raise ArchiveError(f"model store {self.folder}: {exc.strerror or exc}") from None
        return sorted(n for n in found if not n.startswith(".") and (
            n.endswith(SUFFIXES) or os.path.exists(os.path.join(self.folder, n, "MAR-INF", "MANIFEST.json"))))

    def path(self, url: str) -> str:
        """The archive a registration's url names, inside the store."""
        if "://" in url:
            raise ArchiveError(f"url {url!r}: tgw downloads no archive; put the file in the model store "
                               f"({self.folder}) and register it by its name")
        path = os.path.realpath(os.path.join(self.folder, url))
        if not path.startswith(self.folder + os.sep):
            raise ArchiveError(f"url {url!r} is outside the model store ({self.folder})")
        if not os.path.exists(path):
            raise ArchiveError(f"Model file not found in model store: {url}")
        return path

    def open(self, url: str) -> Archive:
        """The archive unpacked (once) and read."""
        archive = unpack(self.path(url), self.unpack_dir)
        for warning in archive.warnings:
            log.warning("%s", warning)
        return archive

    def decl(self, url: str, reg: Registration, device: str) -> tuple[Archive, ModelDecl]:
        """The archive and the stage declaration that serves it (its handler: the entry file's real path)."""
        archive = self.open(url)
        raw = model_decl(archive, reg, device)
        decl = ModelDecl.model_validate(raw)
        decl = decl.model_copy(update={"versions": [v.model_copy(update={"format": "stage"}) for v in decl.versions]})
        return archive, decl

    def startup(self, wanted: list[str]) -> list[tuple[str, Registration]]:
        """TorchServe's --models: "all", "NAME=FILE" (served as NAME) or "FILE"."""
        out = []
        for item in wanted:
            if item == "all":
                out += [(n, Registration()) for n in self.names()]
            elif "=" in item:
                name, url = item.split("=", 1)
                out.append((url, Registration(model_name=name)))
            else:
                out.append((item, Registration()))
        return out


def with_flags(cfg: Config, store: str | None, models: list[str] | None, inference_port: int | None,
               management_port: int | None) -> Config:
    """`tgw-broker start`'s TorchServe flags over the config's keys."""
    if store is None and models is None and inference_port is None and management_port is None:
        return cfg
    for flag, port in (("--ts-inference-port", inference_port), ("--ts-management-port", management_port)):
        if port is not None and not 0 <= port <= 65535:
            raise ConfigError(f"{flag} must be 0..65535, got {port}")
    if (store or cfg.model_store) is None:
        raise ConfigError("--models and the --ts-*-port flags serve archives of a model store: give --model-store "
                          "(or model_store: in the config)")
    ts = cfg.torchserve or TorchServeDecl()
    update = {k: v for k, v in (("models", models), ("inference_port", inference_port),
                                ("management_port", management_port)) if v is not None}
    return cfg.model_copy(update={"model_store": os.path.abspath(store) if store else cfg.model_store,
                                  "torchserve": ts.model_copy(update=update)})


def with_store(cfg: Config) -> Config:
    """The config with the archives its `torchserve.models` names served beside its models
    (ConfigError: an archive that cannot be served, or nothing served at all)."""
    if cfg.model_store is None:
        return cfg
    ts = cfg.torchserve
    store = ModelStore(cfg.model_store, ts.unpack_dir if ts else None)
    decls = []
    try:
        for url, reg in store.startup(ts.models if ts else []):
            decls.append(store.decl(url, reg, ts.device if ts else "cpu")[1])
    except ArchiveError as exc:
        raise ConfigError(f"model_store: {exc}") from None
    except ValueError as exc:   # the declaration refused (a model name TorchServe allows and tgw does not)
        raise ConfigError(f"model_store: {exc}") from None
    if not cfg.models and not decls:
        raise ConfigError("model_store: no model is served at start: name archives with torchserve.models "
                          "(--models NAME=FILE.mar, or all), as TorchServe's --models (tgw serves at least one "
                          "model from the start)")
    return with_models(cfg, decls, [store.unpack_dir] if decls else [])


@dataclass
class Served:
    """One archive version the TorchServe face serves: what describe answers."""
    url: str
    batch_size: int
    max_batch_delay: int
    response_timeout: int
    workers: int
    startup: bool


def served_at_start(cfg: Config) -> dict[str, dict[str, Served]]:
    """The catalog's start: every configured model made from an archive (options.torchserve)."""
    catalog: dict[str, dict[str, Served]] = {}
    for m in cfg.models:
        ts = m.options.get("torchserve") if isinstance(m.options, dict) else None
        if not ts:
            continue
        for v in m.versions:
            catalog.setdefault(m.name, {})[v.version] = Served(
                url=ts.get("url", ""), batch_size=m.max_batch_size, max_batch_delay=ts.get("max_batch_delay", 0),
                response_timeout=m.timeout_ms // 1000, workers=1, startup=True)
    return catalog
