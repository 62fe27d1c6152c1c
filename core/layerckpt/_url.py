"""What a Config can check of a remote URL without reaching it: its shape, its protocol and the package that
implements it.  A leaf (fsspec is imported only when a URL is checked), so the Config does not pull in the
stores."""
from __future__ import annotations

from typing import Any, Dict, Mapping, Optional

from .errors import ConfigError


def is_url(path: Any) -> bool:
    return isinstance(path, str) and "://" in path


def _fsspec():
    try:
        import fsspec
    except ImportError:
        raise ConfigError("Config.remote needs fsspec: pip install 'layerckpt[remote]'") from None
    return fsspec


def check_config(remote: Any, options: Any) -> None:
    """Config-time checks of ``Config.remote`` and ``Config.remote_options``: no I/O, only the URL's shape,
    its protocol and the package that implements it."""
    if not isinstance(options, Mapping) or not all(isinstance(k, str) for k in options):
        raise ConfigError(f"Config.remote_options must map option names to values (passed to fsspec), "
                          f"got a {type(options).__name__}")  # never its values: they may be credentials
    if remote is None:
        if options:
            raise ConfigError("Config.remote_options is set but Config.remote is not; set remote to a URL "
                              "such as 's3://bucket/prefix'")
        return
    if not isinstance(remote, str) or not is_url(remote):
        raise ConfigError(f"Config.remote must be a URL such as 's3://bucket/prefix' or 'file:///mnt/ckpt', "
                          f"got {remote!r}")
    proto = remote.split("://", 1)[0]
    if not remote.split("://", 1)[1].strip("/"):
        raise ConfigError(f"Config.remote {remote!r} names no bucket or folder; use e.g. '{proto}://bucket/prefix'")
    fsspec = _fsspec()
    if proto not in fsspec.available_protocols():
        raise ConfigError(f"Config.remote {remote!r}: fsspec knows no protocol {proto!r} (known: s3, gs, az, "
                          f"file, memory, ...); check the URL's scheme")
    try:
        fsspec.get_filesystem_class(proto)
    except ImportError as e:
        raise ConfigError(f"Config.remote {remote!r} needs the package that implements {proto}:// ({e})") from None



#: what a request to S3 may wait, in seconds, where ``Config.remote_options`` names no bound of its own: to
#: connect, and for the next bytes of an answer (botocore's own defaults are a minute each; recent s3fs versions
#: set these values themselves, set here whatever the version)
S3_CONNECT_TIMEOUT, S3_READ_TIMEOUT = 5, 15


def bounded(url: str, options: Optional[Mapping[str, Any]]) -> Dict[str, Any]:
    """The file system's keyword arguments for ``url``: ``options`` (``Config.remote_options``), with a bound on
    how long a request may wait wherever the file system takes one and the caller gave none (S3: botocore's
    connect and read timeouts), so that no remote read waits forever on a server that stopped answering."""
    out = dict(options or {})
    if url.split("://", 1)[0] in ("s3", "s3a"):
        kw = dict(out.get("config_kwargs") or {})
        kw.setdefault("connect_timeout", S3_CONNECT_TIMEOUT)
        kw.setdefault("read_timeout", S3_READ_TIMEOUT)
        out["config_kwargs"] = kw
    return out
