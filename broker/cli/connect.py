"""How a `tgw-broker` verb reaches a running broker: its connection flags (--address, --config,
--token-file, --server-key) and what they resolve to.

`--config FILE` reads what the broker itself reads from that file: `server.address`,
`server.auth_token_file`, and the public key of `server.curve_secret_key_file` (the `.key`
beside it when readable, as `tgw-broker keygen` writes the pair). A flag given beside it wins,
as `start --address` wins over the config's address; the environment ($TGW_ADDRESS, $TGW_TOKEN,
$TGW_SERVER_KEY) fills only what neither says.
"""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

SECRET_SUFFIX = "_secret"   # keygen: NAME.key (public) beside NAME.key_secret


class ConnectProblem(ValueError):
    """The flags name no usable broker connection; the message says why, in one line."""


@dataclass(frozen=True)
class Connection:
    address: str
    token: str | None
    server_key: str | None     # z85 text or a certificate file (shm.keys reads either)


def add_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--address", help="the broker's address (default: the --config's server.address, else "
                                          "$TGW_ADDRESS, else the broker's default); wins over --config")
    parser.add_argument("--config", metavar="FILE",
                        help="the broker's config file: its server.address, server.auth_token_file and the public "
                             "key of server.curve_secret_key_file are used (a flag given beside it wins)")
    parser.add_argument("--token-file", help="file holding the broker's auth token (default: the --config's "
                                             "server.auth_token_file, else $TGW_TOKEN, the token)")
    parser.add_argument("--server-key", help="the broker's CURVE public key: its .key file or z85 text (default: "
                                             "the --config's key, else $TGW_SERVER_KEY; needed for tcp://)")


def resolve(args) -> Connection:
    """The address, token and server key the flags (and --config, and the environment) name;
    ConnectProblem or the auth module's StartupError (a bad token file) when they name none."""
    from tgw.shm.paths import default_address

    from tgw.broker.front.auth import load_token
    server = _server_section(args.config) if args.config else None
    address = args.address or (server.address if server else None) or default_address()
    token_file = args.token_file or (server.auth_token_file if server else None)
    token = load_token(token_file) if token_file else os.environ.get("TGW_TOKEN", "").strip() or None
    config_key = public_key_file(server.curve_secret_key_file) if server and server.curve_secret_key_file else None
    server_key = args.server_key or config_key or os.environ.get("TGW_SERVER_KEY") or None
    return Connection(address, token, server_key)


def _server_section(path: str):
    from tgw.broker.config.load import ConfigError, load_config
    try:
        return load_config(path).server
    except ConfigError as exc:
        raise ConnectProblem(f"--config: {exc}") from None


def public_key_file(secret_file: str) -> str:
    """The certificate to read the broker's public key from: the public `.key` beside the secret
    one when it is there (anyone may read it), else the secret file (it holds the public key too)."""
    if secret_file.endswith(SECRET_SUFFIX):
        public = secret_file[:-len(SECRET_SUFFIX)]
        if os.path.isfile(public):
            return public
    return secret_file
