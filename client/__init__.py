"""tgw.client: the Python client library (numpy in, numpy out; torch tensors accepted lazily).

    from tgw.client import Client
    with Client() as c:
        y = c.infer("mlp", {"x": np.zeros((4, 256), np.float32)})["y"]
"""
from tgw.shm.errors import ERROR_CLASSES, Code, TgwError

from .client import Client, ConnectError

globals().update({cls.__name__: cls for cls in ERROR_CLASSES.values()})

__all__ = ["Client", "ConnectError", "TgwError", "Code", *(cls.__name__ for cls in ERROR_CLASSES.values())]
