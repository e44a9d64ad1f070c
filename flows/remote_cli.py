"""`arlflow remote add | show | push | pull`: the project's DVC remote on S3 (AWS or any S3-compatible server such
as the SeaweedFS of infra/s3-local.sh), and the S3 transfers of `arlflow pool export/import`.

Credentials come from the environment only (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, optionally
AWS_SESSION_TOKEN, or AWS_PROFILE: what boto3 and DVC's S3 remote both read). Nothing here writes them, `add`
refuses a URL that carries them, and `show` says whether they are set, never what they are. `.dvc/config` holds
the URL and the endpoint, which a team shares through git. push and pull are DVC's own `dvc push` / `dvc pull`:
the wrappers first make one signed request to the remote, so missing or refused credentials and an unreachable
endpoint end in one line saying what to do instead of DVC's "unexpected error - Forbidden", and a push that stops
part-way says why and that rerunning it sends only what is missing.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Iterator, Optional
from urllib.parse import urlsplit

import typer

CREDENTIAL_VARS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE")
SECRET_OPTIONS = ("access_key_id", "secret_access_key", "session_token")
"""Options of a DVC S3 remote that hold secrets: `add` never writes them, `show` and push/pull warn if found."""
REFUSED_CODES = {"SignatureDoesNotMatch", "InvalidAccessKeyId", "AccessDenied", "InvalidToken", "ExpiredToken",
                 "403", "Forbidden"}
MISSING_CODES = {"NoSuchKey", "404", "NotFound"}
RETRIES = {"max_attempts": 2, "mode": "standard"}
"""botocore retries of every S3 request arlflow makes, and of DVC's push/pull unless the user configured their own
(AWS_MAX_ATTEMPTS / AWS_RETRY_MODE, or max_attempts / retry_mode in the AWS profile): one retry rides out a blip,
and a server that went down mid-push is reported in seconds. botocore's default (legacy, 5 attempts with
exponential backoff) kept a cut-off push of 100 files retrying each one for 90 s."""
ENDPOINT_HELP = ("S3 endpoint of a non-AWS server, e.g. http://127.0.0.1:8333 (default: AWS_ENDPOINT_URL, else "
                 "AWS S3)")

remote_app = typer.Typer(help="The DVC remote on S3: where `dvc push` sends a run's data, models and metrics.",
                         no_args_is_help=True, pretty_exceptions_enable=False)


class S3Error(RuntimeError):
    """An S3 URL or request failed; the message says why and what to do (and holds no credential)."""


def _redact(url: str) -> str:
    """``url`` with any user:password part replaced, for messages."""
    parts = urlsplit(url)
    return url.replace(parts.netloc, "***@" + parts.netloc.rsplit("@", 1)[1], 1) if "@" in parts.netloc else url


def is_s3(path: str) -> bool:
    return path.startswith("s3://")


def split_s3_url(url: str) -> tuple[str, str]:
    """(bucket, key) of ``s3://BUCKET/KEY``; refuses credentials, a query or a fragment in the URL."""
    parts = urlsplit(url)
    if parts.scheme != "s3":
        raise S3Error(f"{_redact(url)} is not an s3:// URL: give s3://BUCKET/PREFIX (other kinds: `dvc remote add`)")
    if "@" in parts.netloc:
        raise S3Error(f"{_redact(url)} carries credentials: drop them from the URL and export AWS_ACCESS_KEY_ID "
                      "and AWS_SECRET_ACCESS_KEY instead (they must never be written to .dvc/config or params)")
    if parts.query or parts.fragment:
        raise S3Error(f"s3://{parts.netloc}{parts.path} is given with a query or fragment (which may carry a "
                      "signature): give a plain s3://BUCKET/PREFIX")
    if not parts.netloc:
        raise S3Error(f"{url} names no bucket: give s3://BUCKET/PREFIX")
    return parts.netloc, parts.path.lstrip("/")


def split_object_url(url: str) -> tuple[str, str]:
    """(bucket, key) of ``s3://BUCKET/KEY``, refusing a URL that names no object (a bucket or a folder)."""
    bucket, key = split_s3_url(url)
    if not key or key.endswith("/"):
        raise S3Error(f"{url} names no object: give s3://BUCKET/KEY.parquet")
    return bucket, key


def check_endpoint(endpoint: str) -> str:
    """``endpoint`` if it is a plain http(s)://HOST[:PORT][/PATH] without credentials."""
    parts = urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise S3Error(f"endpoint {_redact(endpoint)} is not an http(s):// URL: give e.g. http://127.0.0.1:8333")
    if "@" in parts.netloc or parts.query:
        raise S3Error(f"endpoint {_redact(endpoint)} carries credentials or a query: give the bare URL and export "
                      "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY instead")
    return endpoint


def s3_client(endpoint: str | None = None, *, profile: str | None = None):
    """A boto3 S3 client: credentials, region and (without ``endpoint``) AWS_ENDPOINT_URL from the environment.
    Few retries and a short connect timeout, so a down server is reported in seconds, not after a minute."""
    import boto3
    from botocore.config import Config

    session = boto3.Session(profile_name=profile) if profile else boto3.Session()
    return session.client("s3", endpoint_url=check_endpoint(endpoint) if endpoint else None,
                          config=Config(retries=dict(RETRIES), connect_timeout=5))


def explain(err: Exception, client, where: str) -> S3Error:
    """An S3Error saying what a failed request to ``where`` (s3://bucket/key) means and what to do."""
    from boto3.exceptions import S3UploadFailedError
    from botocore.exceptions import (ClientError, ConnectionError as BotoConnectionError, HTTPClientError,
                                     NoCredentialsError, PartialCredentialsError)

    if isinstance(err, S3UploadFailedError) and err.__context__ is not None:  # boto3 wraps the ClientError
        err = err.__context__
    endpoint = _redact(client.meta.endpoint_url)
    if isinstance(err, (NoCredentialsError, PartialCredentialsError)):
        return S3Error(f"no AWS credentials for {where}: export AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or "
                       "AWS_PROFILE); arlflow and DVC read them from the environment only")
    if isinstance(err, (BotoConnectionError, HTTPClientError)):  # refused, timed out, closed mid-request
        return S3Error(f"cannot reach the S3 endpoint {endpoint} for {where} ({type(err).__name__}): is the "
                       "server running (infra/s3-local.sh)? else fix --endpoint / AWS_ENDPOINT_URL")
    if isinstance(err, ClientError):
        code = str(err.response.get("Error", {}).get("Code", ""))
        if code in REFUSED_CODES:
            return S3Error(f"{endpoint} refused the credentials for {where} ({code}): check AWS_ACCESS_KEY_ID and "
                           "AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN) in the environment")
        if code == "NoSuchBucket":
            return S3Error(f"the bucket of {where} does not exist on {endpoint}: create it (`aws s3 mb "
                           f"s3://{urlsplit(where).netloc}`, or for the DVC remote `arlflow remote push "
                           "--create-bucket`)")
        if code in MISSING_CODES:
            return S3Error(f"no object at {where} on {endpoint}: check the key (`aws s3 ls`)")
    return S3Error(f"S3 request for {where} on {endpoint} failed: {err}")


def upload(local: Path, url: str, endpoint: str | None = None) -> None:
    """Store ``local`` as the object ``url``, whole or not at all: boto3 sends one PUT, or above 8 MB a multipart
    upload that it aborts on failure; S3 shows the key only once the upload completed."""
    bucket, key = split_object_url(url)
    client = s3_client(endpoint)
    try:
        client.upload_file(str(local), bucket, key)
    except Exception as err:  # noqa: BLE001 - boto3's errors, explained
        raise explain(err, client, url) from err


@contextmanager
def local_target(path: str, endpoint: str | None = None) -> Iterator[Path]:
    """A local file to write ``path`` to: ``path`` itself, or for s3:// a temporary file (named like the key)
    uploaded as one object when the block ends without an error; nothing is uploaded otherwise."""
    if not is_s3(path):
        yield Path(path)
        return
    _, key = split_object_url(path)
    with tempfile.TemporaryDirectory(prefix="arlflow-s3-") as tmp:
        local = Path(tmp) / PurePosixPath(key).name
        yield local
        upload(local, path, endpoint)


@contextmanager
def local_source(path: str, endpoint: str | None = None) -> Iterator[Path]:
    """A local file holding ``path``: ``path`` itself, or for s3:// the object downloaded to a temporary file
    named like the key (removed after the block)."""
    if not is_s3(path):
        yield Path(path)
        return
    bucket, key = split_object_url(path)
    client = s3_client(endpoint)
    with tempfile.TemporaryDirectory(prefix="arlflow-s3-") as tmp:
        local = Path(tmp) / PurePosixPath(key).name
        try:
            client.download_file(bucket, key, str(local))
        except Exception as err:  # noqa: BLE001 - boto3's errors, explained
            raise explain(err, client, path) from err
        yield local


# ------------------------------------------------------------------------------------------------ the DVC remote
@dataclass(frozen=True)
class Remote:
    """A DVC remote as the merged DVC config (.dvc/config, .dvc/config.local, user, system) defines it."""
    name: str
    url: str
    endpoint: str | None
    profile: str | None
    secrets: tuple[str, ...]
    """SECRET_OPTIONS found in the DVC config for this remote (names only)."""


def _fail(message: str, code: int = 2) -> typer.Exit:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    return typer.Exit(code)


def _config(root: Path):
    from dvc.config import Config, ConfigError

    if not (root / ".dvc").is_dir():
        raise _fail(f"{root.resolve()} is not a DVC project (no .dvc/): run in the project root or pass --root")
    try:
        return Config(dvc_dir=str((root / ".dvc").resolve()))
    except ConfigError as err:
        raise _fail(f"{err}: fix the file or rerun `arlflow remote add`") from err


def read_remote(root: Path, name: str | None = None) -> Remote:
    """The named (else the default) remote; exits 2 with what to do when there is none or it is not on S3."""
    config = _config(root)
    name = name or config["core"].get("remote")
    if not name:
        raise _fail("no default DVC remote: run `arlflow remote add s3://BUCKET/PREFIX [--endpoint URL]`")
    section = config["remote"].get(name)
    if section is None:
        raise _fail(f"no DVC remote {name!r} (have: {', '.join(config['remote']) or 'none'}): run "
                    "`arlflow remote add`")
    if not is_s3(section["url"]):
        raise _fail(f"remote {name!r} is {section['url']}, not S3: use `dvc push` / `dvc pull` directly")
    return Remote(name, section["url"], section.get("endpointurl"), section.get("profile"),
                  tuple(option for option in SECRET_OPTIONS if option in section))


def access_problem(remote: Remote, *, create_bucket: bool = False) -> str | None:
    """None if one signed request (list one key under the remote's prefix) succeeds, else what is wrong.
    ``create_bucket``: create the bucket when it does not exist (DVC's push of a folder lists it first and fails)."""
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        bucket, prefix = split_s3_url(remote.url)
        client = s3_client(remote.endpoint, profile=remote.profile)
    except (S3Error, BotoCoreError) as err:  # a bad URL or endpoint in the config, an unknown AWS_PROFILE
        return str(err)
    try:
        try:
            client.list_objects_v2(Bucket=bucket, Prefix=prefix, MaxKeys=1)
        except ClientError as err:
            if not (create_bucket and err.response.get("Error", {}).get("Code") == "NoSuchBucket"):
                raise
            region = client.meta.region_name
            client.create_bucket(Bucket=bucket, **({"CreateBucketConfiguration": {"LocationConstraint": region}}
                                                   if region and region != "us-east-1" else {}))
            typer.echo(f"created bucket {bucket}", err=True)
    except Exception as err:  # noqa: BLE001 - boto3's errors, explained
        return str(explain(err, client, remote.url))
    return None


def _warn_secrets(remote: Remote) -> None:
    if remote.secrets:
        typer.secho(f"warning: the DVC config holds {', '.join(remote.secrets)} for remote {remote.name!r}: remove "
                    f"it (`dvc remote modify --unset {remote.name} OPTION`, with --local for .dvc/config.local) "
                    "and export the AWS_* variables instead", fg=typer.colors.YELLOW, err=True)


ROOT_OPTION = typer.Option(Path("."), "--root", help="project root (holds .dvc/)")


@remote_app.command("add")
def add(url: str = typer.Argument(..., help="s3://BUCKET/PREFIX where DVC stores the cache"),
        endpoint: Optional[str] = typer.Option(None, "--endpoint", help="S3 endpoint of a non-AWS server, e.g. "
                                               "http://127.0.0.1:8333 (AWS S3: leave out)"),
        name: str = typer.Option("storage", "--name", help="the remote's name in .dvc/config"),
        root: Path = ROOT_OPTION) -> None:
    """Make s3://BUCKET/PREFIX the project's default DVC remote (URL and endpoint only: no credentials)."""
    try:
        split_s3_url(url)
        if endpoint:
            check_endpoint(endpoint)
    except S3Error as err:
        raise _fail(str(err)) from err
    config = _config(root)
    with config.edit("repo") as conf:  # replaces the section: stale options (an old endpoint, keys) go with it
        conf["remote"][name] = {"url": url, **({"endpointurl": endpoint} if endpoint else {})}
        conf["core"]["remote"] = name
    typer.echo(f"default DVC remote {name!r}: {url}" + (f" at {endpoint}" if endpoint else " (AWS S3)")
               + f" in {config.files['repo']}")
    _warn_secrets(read_remote(root, name))
    typer.echo("next: export AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, then `arlflow remote push` (or `dvc push`)")


@remote_app.command("show")
def show(root: Path = ROOT_OPTION, name: Optional[str] = typer.Option(None, "--name", help="default: the default"),
         check: bool = typer.Option(False, "--check", help="also make one signed request to the remote")) -> None:
    """Where `dvc push` sends data, and which AWS credential variables are set (never their values)."""
    remote = read_remote(root, name)
    env_endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    where = (f"{remote.endpoint} (.dvc/config)" if remote.endpoint else
             f"{_redact(env_endpoint)} (AWS_ENDPOINT_URL)" if env_endpoint else "AWS S3 (no endpoint set)")
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    typer.echo(f"remote: {remote.name} -> {remote.url}")
    typer.echo(f"endpoint: {where}")
    typer.echo(f"region: {region or 'not set (AWS: export AWS_DEFAULT_REGION)'}")
    typer.echo("credentials: " + ", ".join(f"{var} {'set' if os.environ.get(var) else 'not set'}"
                                           for var in CREDENTIAL_VARS))
    _warn_secrets(remote)
    if check:
        problem = access_problem(remote)
        if problem:
            raise _fail(problem, code=1)
        typer.echo("check: reachable, credentials accepted")


def dvc_environment(profile: str | None = None, environ: dict[str, str] | None = None) -> dict[str, str]:
    """The environment DVC runs in: ``environ`` (default os.environ) with RETRIES as AWS_MAX_ATTEMPTS /
    AWS_RETRY_MODE where neither the environment nor the AWS profile's config file sets that option."""
    import botocore.session
    from botocore.exceptions import ProfileNotFound

    env = dict(os.environ if environ is None else environ)
    try:
        scoped = botocore.session.Session(profile=profile or env.get("AWS_PROFILE")).get_scoped_config()
    except ProfileNotFound:  # DVC reports it in its own words
        scoped = {}
    for option, var, value in (("max_attempts", "AWS_MAX_ATTEMPTS", RETRIES["max_attempts"]),
                               ("retry_mode", "AWS_RETRY_MODE", RETRIES["mode"])):
        if var not in env and scoped.get(option) is None:
            env[var] = str(value)
    return env


def _dvc(command: str, root: Path, remote_name: str | None, args: list[str], *, create_bucket: bool = False) -> None:
    """Check access, then run `dvc COMMAND -r REMOTE ARGS...` in ``root``; explain a failure."""
    remote = read_remote(root, remote_name)
    _warn_secrets(remote)
    problem = access_problem(remote, create_bucket=create_bucket)
    if problem:
        raise _fail(f"dvc {command} not started: {problem}")
    done = subprocess.run([sys.executable, "-m", "dvc", command, "-r", remote.name, *args], cwd=root,
                          env=dvc_environment(remote.profile))
    if done.returncode:
        problem = access_problem(remote)
        raise _fail(f"dvc {command} stopped part-way (exit {done.returncode})" + (f": {problem}" if problem else
                    "; see DVC's message above") + f". Each object is written whole: rerun `arlflow remote "
                    f"{command}` to transfer what is missing", code=done.returncode)


EXTRA_ARGS = {"allow_extra_args": True, "ignore_unknown_options": True}


@remote_app.command("push", context_settings=EXTRA_ARGS)
def push(ctx: typer.Context, root: Path = ROOT_OPTION,
         name: Optional[str] = typer.Option(None, "--name", help="remote (default: the default)"),
         create_bucket: bool = typer.Option(False, "--create-bucket", help="create the bucket if it is missing")
         ) -> None:
    """`dvc push` to the S3 remote, after checking credentials and endpoint (other arguments go to DVC)."""
    _dvc("push", root, name, ctx.args, create_bucket=create_bucket)


@remote_app.command("pull", context_settings=EXTRA_ARGS)
def pull(ctx: typer.Context, root: Path = ROOT_OPTION,
         name: Optional[str] = typer.Option(None, "--name", help="remote (default: the default)")) -> None:
    """`dvc pull` from the S3 remote, after checking credentials and endpoint (other arguments go to DVC)."""
    _dvc("pull", root, name, ctx.args)


if __name__ == "__main__":  # `python -m flows.remote_cli ...`, the same commands as `arlflow remote ...`
    remote_app()
