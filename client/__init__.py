"""aotc client: the SDK (`Client`) and the `aotc` command line."""

from client.sdk import Artifact, Client, ClientError, JobFailed

__all__ = ["Artifact", "Client", "ClientError", "JobFailed"]
