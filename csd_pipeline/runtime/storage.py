"""Where stage outputs and inputs live: a local folder or an object store, behind one set of paths.

Every path argument is a local path or an fsspec URL (`s3://`, `gs://`, `memory://`, `file://`, any
installed fsspec protocol). `location(arg)` gives a `pathlib.Path` for a local path (so local runs
behave, and write, exactly as before) and a `upath.UPath` (fsspec's pathlib) for a URL, which the
readers and the executor use with the same methods (`/`, `is_file`, `stat`, `read_bytes`, `open`).

Writing without a rename. An object store has no atomic rename, so a file bound for a URL is written
to a local staging file (`staging_path`), then uploaded whole (`commit`: fsspec's `put_file`, a
completed multipart upload for a large object), and only then is its completion record written, and
the manifest last (runtime/executor.py, runtime/run_record.py): an object whose record is missing
does not exist for a reader, so a writer killed mid-upload leaves nothing a re-run trusts. A small
file (a record, the manifest) is one PUT (`write_bytes`), which an object store applies whole.

Credentials are the libraries' own (the `AWS_*` variables, `AWS_ENDPOINT_URL`, `~/.aws`, gcloud's),
plus `--storage-options JSON` (`configure`): keyword arguments of the fsspec file system, kept in the
environment of this process and its workers, never in a manifest, log line or error message.
`storage_errors.describe_error` turns a failed object-store call into one line naming the URL.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from pathlib import Path

OPTIONS_ENV = "CSD_STORAGE_OPTIONS"  # --storage-options, inherited by worker processes
CACHE_ENV = "CSD_CACHE_DIR"  # --cache-dir: local copies of objects, checked by sha256
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
_EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs"}
_roots: list[str] = []  # the URLs this process was given, to name one in an error line


def is_url(arg) -> bool:
    """True for an fsspec URL other than `file://` (a local path stays a `pathlib.Path`)."""
    return isinstance(arg, str) and bool(_URL.match(arg)) and not arg.startswith("file://")


def is_remote(path) -> bool:
    """True when `path` (a `location`) lives on an object store rather than a local disk."""
    return is_remote_object(path)


def refuse_url(arg, what: str) -> None:
    """Raise `CsdError` when `arg` (a model or tokenizer argument, `what`) is an object-store URL: those are
    read from a local folder or file (transformers and tokenizers open local files), so the user copies them."""
    if is_url(str(arg)):
        from csd_pipeline.errors import CsdError

        raise CsdError(f"{what} {redact(str(arg))}: models and tokenizers are read from a local folder or file, not "
                       "from object storage; copy it to a local disk first (e.g. `aws s3 cp --recursive URL DIR`) "
                       "and pass that folder.")


def configure(options_json: str | None) -> None:
    """Take `--storage-options JSON` (a JSON object of fsspec file system keyword arguments; None:
    keep the environment's). Raises `CsdError` naming the option when it is not a JSON object."""
    from csd_pipeline.errors import CsdError

    if options_json is None:
        return
    try:
        options = json.loads(options_json)
    except ValueError:
        options = None
    if not isinstance(options, dict):
        raise CsdError("--storage-options is not a JSON object (e.g. '{\"endpoint_url\": \"http://host:9000\"}'); "
                       "fix its value.")
    os.environ[OPTIONS_ENV] = json.dumps(options)


def use_cache_dir(path) -> None:
    """Take `--cache-dir DIR`: objects read with a recorded sha256 are read from checked local copies there."""
    os.environ[CACHE_ENV] = os.path.abspath(os.fspath(path))


def take_storage_flags(argv: list[str]) -> list[str]:
    """Apply `--storage-options JSON` and `--cache-dir DIR` (also `--flag=value`) found in `argv` (csd-train's
    arguments) and return the others, so neither reaches the run's saved config."""
    rest, index = [], 0
    while index < len(argv):
        flag, _, inline = argv[index].partition("=")
        if flag in ("--storage-options", "--cache-dir"):
            value = inline if inline else (argv[index + 1] if index + 1 < len(argv) else None)
            index += 1 if inline else 2
            if value is None:
                from csd_pipeline.errors import CsdError

                raise CsdError(f"{flag} needs a value; pass {flag} VALUE.")
            if flag == "--storage-options":
                configure(value)
            else:
                use_cache_dir(value)
        else:
            rest.append(argv[index])
            index += 1
    return rest


def worker_env() -> dict:
    """The variables that `--storage-options` and `--cache-dir` set in this process, for a worker that does
    not inherit its environment from it (a Ray actor)."""
    return {name: os.environ[name] for name in (OPTIONS_ENV, CACHE_ENV) if os.environ.get(name)}


def storage_options() -> dict:
    """The fsspec keyword arguments given with `--storage-options` (empty when none)."""
    text = os.environ.get(OPTIONS_ENV)
    return json.loads(text) if text else {}


def location(arg):
    """A local path as `pathlib.Path` (a `file://` URL too), a URL as `upath.UPath` with the storage
    options; a `Path` or `UPath` passes through. Raises `CsdError` when the protocol's package is
    not installed (naming the extra to install)."""
    if is_remote_object(arg) or isinstance(arg, Path):
        return arg
    arg = os.fspath(arg)
    if arg.startswith("file://"):
        return Path(arg[len("file://"):])
    if not is_url(arg):
        return Path(arg)
    from csd_pipeline.errors import CsdError

    try:
        from upath import UPath

        if arg.split(":", 1)[0].lower() in ("gs", "gcs"):
            import logging

            # gcsfs logs each failed request's traceback; the one error line below says it once
            logging.getLogger("gcsfs").addHandler(logging.NullHandler())
        options = storage_options()
        if arg.split(":", 1)[0].lower() in _EXTRAS:  # s3fs / gcsfs: list the store, never a stale cached listing
            options = {"use_listings_cache": False, **options}
        path = UPath(arg, **options)
        path.fs  # noqa: B018 - the protocol's package is imported here
    except ImportError as err:
        extra = _EXTRAS.get(arg.split(":", 1)[0].lower(), "s3")
        raise CsdError(f"{redact(arg)} needs a package that is not installed ({err}); "
                       f"pip install 'csd-pipeline[{extra}]'.") from None
    except ValueError as err:
        raise CsdError(f"{redact(arg)} is not a storage URL this installation reads ({err}); "
                       "check the protocol, or pass a local path.") from None
    except TypeError as err:
        raise _refused_options(arg, err) from None
    if arg not in _roots:
        _roots.append(arg)
    if path.protocol in _EXTRAS:
        _check_store(path, arg)
    return path


_checked_buckets: set[str] = set()


def _check_store(path, url: str) -> None:
    """The first time this process touches a bucket: one request that fails, as one `CsdError` naming
    `url`, when the endpoint cannot be reached, the credentials are refused or the bucket is missing
    (later calls that swallow errors, such as `is_file`, would otherwise report "not found")."""
    from csd_pipeline.errors import CsdError

    bucket = path.path.split("/", 1)[0]
    key = json.dumps([path.protocol, bucket, os.environ.get("AWS_ENDPOINT_URL"), os.environ.get(OPTIONS_ENV)])
    if key in _checked_buckets:
        return
    try:
        try:
            path.fs.info(path.path)
        except FileNotFoundError:
            if not path.fs.exists(bucket):
                raise CsdError(f"{redact(url)}: the bucket {bucket!r} does not exist (or these credentials cannot see "
                               "it); create it, or fix the URL.") from None
    except CsdError:
        raise
    except TypeError as err:  # the client is made at the first request: an option it does not take
        raise _refused_options(url, err) from None
    except Exception as err:  # noqa: BLE001 - botocore, aiohttp and fsspec raise many types
        from csd_pipeline.runtime.storage_errors import describe_error

        message = describe_error(err, url)
        if message is None:
            raise
        raise CsdError(message) from None
    _checked_buckets.add(key)


def is_remote_object(value) -> bool:
    """True for a `upath.UPath` (what `location` makes of a URL)."""
    return type(value).__module__.startswith("upath")


def _refused_options(url: str, err: TypeError):
    """The `CsdError` for `--storage-options` that the file system does not take (the option's name only,
    never a value: it may be a secret)."""
    from csd_pipeline.errors import CsdError

    name = re.search(r"keyword argument '([^']+)'", str(err))
    what = f"it takes no option {name.group(1)!r}" if name else "an option it does not take"
    return CsdError(f"the file system of {redact(url)} refused --storage-options ({what}); pass only options it "
                    "documents (s3fs: endpoint_url, key, secret, client_kwargs, ...).")


def given_roots() -> list[str]:
    """The URLs this process was given (`location`), oldest first: an error line names one of them."""
    return list(_roots)


def redact(url: str) -> str:
    """`url` without user information (`s3://KEY:SECRET@bucket` -> `s3://bucket`) or query string."""
    url = re.sub(r"^([A-Za-z][A-Za-z0-9+.-]*://)[^/@]*@", r"\1", str(url))
    return url.split("?", 1)[0]


# ---------------------------------------------------------------------------------------------
# Writing


def staging_path(final) -> Path:
    """The local file a writer writes before `commit`: next to `final` on a local disk (`<name>.<host>.
    <pid>.tmp`, runtime/files.py), in a per-folder staging directory for an object-store URL."""
    from csd_pipeline.runtime.files import tmp_path

    if not is_remote(final):
        return tmp_path(final)
    folder = hashlib.sha256(str(final.parent).encode()).hexdigest()[:16]
    staging = staging_root() / folder
    staging.mkdir(parents=True, exist_ok=True)
    return tmp_path(staging / final.name)


def staging_root() -> Path:
    """The local folder under which every object-store writer of this host stages its files."""
    return Path(tempfile.gettempdir()) / "csd-pipeline-staging"


def upload(tmp: Path, final) -> None:
    """Upload the finished local file `tmp` whole to the object `final` (multipart for a large one,
    completed before this returns), then remove `tmp`."""
    final.fs.put_file(str(tmp), final.path)
    tmp.unlink(missing_ok=True)


def upload_folder(local: Path, target, last: str, replace: bool = True) -> None:
    """Replace the object folder `target` by the local folder `local` (then removed): every file,
    `last` (the file a reader opens first, e.g. an HF export's config.json) after all the others, so
    a reader never finds it next to missing files. `replace=False`: keep the objects already under
    `target` that `local` does not overwrite (as writing into a local folder would)."""
    import shutil

    if replace and target.exists():
        target.fs.rm(target.path, recursive=True)
    files = sorted((p for p in local.rglob("*") if p.is_file()), key=lambda p: (p.name == last, str(p)))
    for path in files:
        target.fs.put_file(str(path), (target / path.relative_to(local).as_posix()).path)
    shutil.rmtree(local, ignore_errors=True)


def write_object(final, data: bytes) -> None:
    """Write `data` as the object `final` in one request (an object store applies it whole)."""
    final.fs.pipe_file(final.path, data)


def remove_staged(final_names, directory) -> None:
    """Remove the local staging files that a killed writer of this host left for `directory`'s files."""
    for name in final_names:
        for path in staging_path(directory / name).parent.glob(f"{name}.*.tmp"):
            path.unlink(missing_ok=True)


def check_writable(out) -> None:
    """For an object-store `out`: the bucket exists and an object can be written and removed there
    (a missing bucket or denied credentials fail here, before any work). Raises `CsdError`."""
    from csd_pipeline.errors import CsdError

    bucket = out.path.split("/", 1)[0]
    try:
        if not out.fs.exists(bucket):
            raise CsdError(f"--output {redact(str(out))}: the bucket {bucket!r} does not exist (or these credentials "
                           "cannot see it); create it, or pass an --output in an existing bucket.")
        probe = out / ".write-probe"
        out.fs.pipe_file(probe.path, b"")
        out.fs.rm_file(probe.path)
    except CsdError:
        raise
    except Exception as err:  # noqa: BLE001 - botocore, aiohttp and fsspec raise many types
        from csd_pipeline.runtime.storage_errors import describe_error

        message = describe_error(err, str(out))
        if message is None:
            raise
        raise CsdError(message) from None


# ---------------------------------------------------------------------------------------------
# Reading


def open_input(path):
    """A binary file object that streams `path` (a local path: the file itself)."""
    path = location(path)
    return path.open("rb") if is_remote(path) else open(path, "rb")


def local_file(path) -> Path:
    """A local file with the bytes of `path`: the file itself on a local disk; for an object (a small
    one: a table, a tokenizer file) a copy in the download cache (`--cache-dir`, else a temporary folder),
    named by the object's URL, size and ETag: made once per version of the object, shared by processes."""
    from csd_pipeline.runtime.files import tmp_path

    path = location(path)
    if not is_remote(path):
        return path
    info = path.fs.info(path.path)
    version = info.get("ETag") or info.get("etag") or info.get("mtime") or f"process {os.getpid()}"
    key = hashlib.sha256(f"{path}|{info.get('size')}|{version}".encode()).hexdigest()[:24]
    target = _download_root() / "files" / f"{key}{path.suffix}"
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        building = tmp_path(target)
        path.fs.get_file(path.path, str(building))
        os.replace(building, target)
    return target


def _download_root() -> Path:
    """Where object-store downloads are kept: `--cache-dir` when given, else one temporary folder."""
    return Path(os.environ.get(CACHE_ENV) or Path(tempfile.gettempdir()) / "csd-pipeline-downloads")


def model_copy(folder) -> Path:
    """A local copy of the object-store folder `folder` (a model that a loader reads from a local folder, e.g.
    a csd-train export): made under `--cache-dir` (else a temporary folder) in a folder named by the URL,
    checked against the store's listing (every object there, with its size), and made again when that
    listing (names, sizes, ETags) changed since. Raises `CsdError` when the folder is empty or a file
    arrives with another size."""
    from csd_pipeline.errors import CsdError
    from csd_pipeline.runtime.files import atomic_write_json, replace_directory, tmp_path

    base = folder.path.rstrip("/") + "/"
    listing = {info["name"][len(base):]: [info["size"], info.get("ETag") or info.get("etag")]
               for info in folder.fs.find(folder.path, detail=True).values() if info["name"].startswith(base)}
    if not listing:
        raise CsdError(f"{redact(str(folder))} holds no files; pass a model folder that exists.")
    root = _download_root() / "models"
    local = root / hashlib.sha256(str(folder).encode()).hexdigest()[:16]
    stamp = local.with_name(local.name + ".listing.json")
    if local.is_dir() and stamp.is_file() and json.loads(stamp.read_text()) == listing:
        return local
    building = tmp_path(local)
    for name, (size, _) in listing.items():
        target = building / name
        target.parent.mkdir(parents=True, exist_ok=True)
        folder.fs.get_file(base + name, str(target))
        if target.stat().st_size != size:
            raise CsdError(f"{redact(str(folder))}/{name}: {target.stat().st_size} bytes arrived of {size}; "
                           "run the command again.")
    replace_directory(building, local)
    atomic_write_json(stamp, listing)
    return local


def readable(path, sha256: str | None):
    """What to read `path` from: with `--cache-dir` (`CSD_CACHE_DIR`) and a recorded `sha256`, the
    checked local copy of an object (`cached_copy`); otherwise `path` itself, streamed."""
    path = location(path)
    cache_dir = os.environ.get(CACHE_ENV)
    if not is_remote(path) or not cache_dir or sha256 is None:
        return path
    return cached_copy(path, sha256, cache_dir)


def parquet_source(path):
    """What `pyarrow.parquet.ParquetFile` / `read_metadata` take for `path`: a path string on a local
    disk; on an object store a file of pyarrow's file system over fsspec's (`PyFileSystem(FSSpecHandler)`),
    which reads the footer and the row groups asked for by ranged requests, never the whole object."""
    path = location(path)
    if not is_remote(path):
        return str(path)
    from pyarrow.fs import FSSpecHandler, PyFileSystem

    return PyFileSystem(FSSpecHandler(path.fs)).open_input_file(path.path)


def cached_copy(path, sha256: str, cache_dir) -> Path:
    """A local copy of `path` in `cache_dir`, named by its `sha256` and checked against it: made once
    (downloaded, hashed, renamed into place), then reused while its bytes still hash to `sha256`.
    Raises `CsdError` when the downloaded bytes have another sha256."""
    from csd_pipeline.errors import CsdError
    from csd_pipeline.runtime.files import atomic_path, file_sha256

    target = Path(cache_dir) / sha256[:2] / f"{sha256}{Path(str(path)).suffix}"
    if target.is_file() and file_sha256(target) == sha256:
        return target
    with atomic_path(target) as tmp:
        with open_input(path) as source, open(tmp, "wb") as sink:
            digest = hashlib.sha256()
            for block in iter(lambda: source.read(1 << 20), b""):
                digest.update(block)
                sink.write(block)
        if digest.hexdigest() != sha256:
            raise CsdError(f"{redact(str(path))} does not have the sha256 its manifest records; re-run the stage "
                           "that wrote it (its bytes changed after the manifest was written).")
    return target
