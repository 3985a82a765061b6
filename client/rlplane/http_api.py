"""ServiceAPI: the client's HTTP connection to a running rlplane service.

It adds the bearer token, speaks JSON to the control plane and rlplane envelopes to the
data endpoints, and turns the service's error answers back into the typed errors of
``rlplane.errors`` (a 422 naming a field raises the same ShapeError a local check would).

Example::

    api = ServiceAPI("http://127.0.0.1:8000", token="s3cret")
    api.json("GET", "/v1/registry")["version"]
"""

from __future__ import annotations

import os
import time
import weakref
from typing import Any

import httpx
import numpy as np

from rlplane.opstats import add_wait
from rlplane.readpool import ReadPool
from rlplane.shared import Refcounted
from rlplane.errors import (
    AuthenticationError,
    PayloadTooLargeError,
    RlplaneError,
    TransportError,
    error_from_payload,
)


_HttpKey = tuple[int, str, "str | None", float]
def _new_http(key: _HttpKey) -> httpx.Client:
    http = httpx.Client(base_url=key[1], timeout=httpx.Timeout(key[3], connect=10.0))
    if key[2]:
        http.headers["Authorization"] = f"Bearer {key[2]}"
    return http


def _close_http(key: _HttpKey, http: httpx.Client) -> None:
    if key[0] == os.getpid():  # a parent's connections are never closed in a forked child
        http.close()


#: Clients of one service with one token share its connection pool (httpx.Client is
#: thread-safe), so a hundred cost the sockets of one: (pid, url, token, timeout) -> client.
_CLIENTS: Refcounted[httpx.Client] = Refcounted(make=_new_http, closed=lambda h: h.is_closed, close=_close_http)


def checked_url(url: Any) -> str:
    """``url`` without a trailing slash, once it is an http(s) URL of a host and a valid port
    (TransportError saying what is wrong, never quoting a password the URL carries).

    Example: ``checked_url("http://127.0.0.1:8000/")  # 'http://127.0.0.1:8000'``
    """
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise TransportError(f"service URL must be a string starting with http:// or https://, got "
                             f"{shown_url(url)!r}")
    try:
        parsed = httpx.URL(url)
        if parsed.port is not None and not 0 < parsed.port < 65536:  # (a number that is not a port raises here)
            raise ValueError(f"port {parsed.port} is not in 1-65535")
    except (httpx.InvalidURL, ValueError, TypeError) as err:
        raise TransportError(f"service URL {shown_url(url)!r} does not parse ({err}); e.g. "
                             "http://127.0.0.1:8000") from None
    if not parsed.host:
        raise TransportError(f"service URL {shown_url(url)!r} names no host; e.g. http://127.0.0.1:8000")
    return url.rstrip("/")


def shown_url(url: Any) -> Any:
    """``url`` with any ``user:password@`` taken out (for messages)."""
    if not isinstance(url, str) or "@" not in url:
        return url
    scheme, _, rest = url.partition("://")
    host = rest.split("/", 1)[0]
    return url.replace(host, "***@" + host.rsplit("@", 1)[1], 1) if "@" in host else url


class ServiceAPI:
    """HTTP access to one service (see the module docstring). Every ServiceAPI of a
    process for the same URL, token and timeout shares one connection pool; it closes with
    the last of them (close(), or garbage)."""

    def __init__(
        self, url: str, *, token: str | None = None, timeout: float = 300.0, http: httpx.Client | None = None
    ) -> None:
        self.url = checked_url(url)
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._token, self._timeout = token, timeout
        self._own = http is None  # tests pass an in-process client (fastapi.testclient.TestClient)
        self._finalizer: weakref.finalize | None = None
        if http is None:
            self._take()
        else:
            self._http = http
            self._http.headers.update(self._headers)
        self._pid = os.getpid()
        self.closed = False

    def _take(self) -> None:
        key = (os.getpid(), self.url, self._token, float(self._timeout))
        self._http = _CLIENTS.hold(key)
        self._finalizer = weakref.finalize(self, _CLIENTS.let_go, key, self._http)
        self._finalizer.atexit = False

    @property
    def http(self) -> httpx.Client:
        """The HTTP client; a forked child gets its own (never its parent's connections)."""
        if self.closed:
            raise TransportError(f"the connection to {shown_url(self.url)} was closed; connect again "
                                 "(rlplane.connect)")
        if self._pid != os.getpid() and self._own:
            if self._finalizer is not None:
                self._finalizer.detach()
            self._take()
            self._pid = os.getpid()
        return self._http

    def request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """One request; a non-2xx answer raises the typed error it carries."""
        http = self.http
        start = time.monotonic()
        try:
            response = http.request(method, path, **kwargs)
        except httpx.HTTPError as err:
            raise TransportError(f"{method} {shown_url(self.url)}{path} failed: {err}. Is the service running "
                                 "(rlplane serve)?") from err
        finally:
            add_wait(time.monotonic() - start)  # (blocked on the service: rlplane.opstats)
        if response.is_success:
            return response
        raise self._error(response, f"{method} {path}")

    def read_into(self, method: str, path: str, **kwargs: Any) -> np.ndarray | bytearray:
        """A data call whose answer is streamed into one writable buffer, each piece copied
        once into place: an answer that declares its length (the service's do) lands in
        memory of the process's :class:`~rlplane.readpool.ReadPool` (pages an earlier
        answer faulted in, reused once nothing refers to it), else in a growing ``bytearray``.
        TransportError when the answer's length is not the one it declared."""
        http = self.http
        start = time.monotonic()
        try:
            with http.stream(method, path, **kwargs) as response:
                add_wait(time.monotonic() - start)  # (until the answer starts: its body is copied below)
                if not response.is_success:
                    response.read()
                    raise self._error(response, f"{method} {path}")
                size = response.headers.get("content-length")
                if not (size and size.isdigit()):
                    grown = bytearray()
                    for chunk in response.iter_raw():
                        grown += chunk
                    return grown
                out = ReadPool.shared().take(int(size))
                into, pos = memoryview(out), 0
                for chunk in response.iter_raw():
                    if pos + len(chunk) > out.size:
                        raise TransportError(f"{method} {path}: the answer is longer than the {out.size} bytes it declared")
                    into[pos : pos + len(chunk)] = chunk
                    pos += len(chunk)
        except httpx.HTTPError as err:
            raise TransportError(f"{method} {shown_url(self.url)}{path} failed: {err}. Is the service running "
                                 "(rlplane serve)?") from err
        if pos != out.size:
            raise TransportError(f"{method} {path}: the answer ended after {pos} of {out.size} bytes")
        return out

    def json(self, method: str, path: str, **kwargs: Any) -> Any:
        """A control-plane call; returns the decoded JSON."""
        return self.request(method, path, **kwargs).json()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self._finalizer is not None:
            self._finalizer()  # let go of the shared pool (closed with its last holder)
        elif self._pid == os.getpid():
            self._http.close()

    def _error(self, response: httpx.Response, what: str) -> RlplaneError:
        try:
            payload = response.json()
        except ValueError:
            payload = None
        code = response.status_code
        if isinstance(payload, dict) and "error" in payload:
            default = AuthenticationError if code == 401 else TransportError
            return error_from_payload(payload, default=default)
        text = response.text[:300]
        if code == 401:
            return AuthenticationError(f"{what}: the service wants a token (401): {text}")
        if code == 413:
            return PayloadTooLargeError(f"{what}: request body too large for the service (413): {text}")
        return TransportError(f"{what}: HTTP {code}: {text}")


__all__ = ["ServiceAPI"]
