"""aotc client: the SDK (`Client`) and the `aotc` command line."""

import sys

# `import httpx` also imports httpx's own command-line tool (httpx._main: click, rich, pygments) whenever those are
# installed: 60-140 ms of a serving process's start, before its first call (bench/README.md, "Weights onto the GPU
# in pinned chunks"). Nothing here runs that tool, so httpx is imported without it (its package falls back to a stub
# `main`), and `httpx._main` stays importable for whoever wants it afterwards.
if "httpx" not in sys.modules and "httpx._main" not in sys.modules:
    sys.modules["httpx._main"] = None  # type: ignore[assignment]
    try:
        import httpx  # noqa: F401
    finally:
        del sys.modules["httpx._main"]

from client.buckets import BucketedModel, Bundle  # noqa: E402
from client.sdk import Artifact, Client, ClientError, JobFailed  # noqa: E402

__all__ = ["Artifact", "BucketedModel", "Bundle", "Client", "ClientError", "JobFailed"]
