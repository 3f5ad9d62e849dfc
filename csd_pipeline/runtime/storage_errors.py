"""One line for a failed object-store call: where it failed, why, and what to do.

botocore, aiohttp, gcsfs and fsspec raise many types; the line names a URL this process was given (never a
credential) and the fix for each kind of failure (endpoint, bucket, access, a missing object)."""

from __future__ import annotations

import re

from csd_pipeline.runtime.storage import given_roots, is_url, redact


def _kind(err: BaseException) -> str | None:
    name, text = type(err).__name__, str(err)
    chain = [err, err.__cause__, err.__context__]
    names = " ".join(type(e).__name__ for e in chain if e is not None)
    if "EndpointConnectionError" in names or "ClientConnectorError" in names or "Could not connect" in text:
        return "endpoint"
    if "NoSuchBucket" in text or "bucket does not exist" in text.lower():
        return "bucket"
    if (isinstance(err, PermissionError) or "AccessDenied" in text or "InvalidAccessKeyId" in text
            or "SignatureDoesNotMatch" in text or "Forbidden" in text or "NoCredentialsError" in names):
        return "denied"
    if isinstance(err, FileNotFoundError) or name == "NoSuchKey":
        return "missing"
    return None


_ADVICE = {
    "endpoint": ("the object store cannot be reached", "check AWS_ENDPOINT_URL (or endpoint_url in "
                 "--storage-options) and that the server is up"),
    "bucket": ("its bucket does not exist", "create the bucket or fix the URL"),
    "denied": ("access was denied", "check the credentials (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, "
               "~/.aws, or --storage-options) and the bucket's policy"),
    "gs-endpoint": ("the object store cannot be reached", "check endpoint_url in --storage-options (or "
                    "STORAGE_EMULATOR_HOST) and the network"),
    "gs-denied": ("access was denied", "check the credentials (GOOGLE_APPLICATION_CREDENTIALS, `gcloud auth "
                  "application-default login`, or token in --storage-options) and the bucket's IAM policy"),
    "missing": ("an object it lists is missing", "it was deleted after its stage wrote it: re-run that stage into a "
                "new --output, or restore the object"),
}


def describe_error(err: BaseException, url: str | None = None) -> str | None:
    """One line for an object-store failure, naming the URL (never a credential) and what to do; None
    when `err` is not one (or no URL was in play)."""
    kind, roots = _kind(err), given_roots()
    where = _failed_url(err, roots) or url or (roots[-1] if roots else None)
    if kind is None or where is None or not (roots or is_url(where)):
        return None
    google = re.match(r"(gs|gcs)://", redact(where)) and f"gs-{kind}" in _ADVICE
    reason, advice = _ADVICE[f"gs-{kind}" if google else kind]
    return f"object storage failed at {redact(where)} ({reason}); {advice}, then re-run the same command."


def _failed_url(err: BaseException, roots: list[str]) -> str | None:
    """The object `err` names, when it lies under a URL this process was given (an API path such as gcsfs's
    `.../b/BUCKET/o/KEY` is not one: the URL given is named instead)."""
    text = str(err)
    for root in roots:
        protocol = root.split("://", 1)[0]
        bucket = root.split("://", 1)[1].split("/", 1)[0]
        for match in re.finditer(re.escape(bucket) + r"[^\s'\"]*", text):
            found = f"{protocol}://{match.group(0)}"
            if any(redact(found).startswith(redact(r).rstrip("/")) for r in roots):
                return found
    return None
