"""ckptd: transparent checkpoint/restart for long-running training jobs."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from ckptd.client import Client

__all__ = ["Client", "__version__"]


def __getattr__(name: str) -> Any:
    # `from ckptd import Client` without importing the client (and gRPC) for
    # every user of the package: the CLIs' read-only commands stay quick
    if name == "Client":
        from ckptd.client import Client

        return Client
    raise AttributeError(f"module 'ckptd' has no attribute {name!r}")
