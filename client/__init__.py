"""aotc client: the SDK (`Client`) and the `aotc` command line."""

from client.buckets import BucketedModel, Bundle
from client.sdk import Artifact, Client, ClientError, JobFailed

__all__ = ["Artifact", "BucketedModel", "Bundle", "Client", "ClientError", "JobFailed"]
