"""Tenants: API tokens scoped to partition-name prefixes, read-only or read-write.

``RLPLANE_TOKENS_FILE`` names a YAML (or JSON) file::

    tokens:
      - name: job-a                 # the tenant (1-64 letters, digits, _ and -)
        token: "a-long-random-secret"
        prefixes: ["job-a:"]        # the partitions it may touch: names starting with one of these
        access: read-write          # or read: list, describe, read, claim/ack/nack, consumption
      - name: eval
        token: "another-secret"
        prefixes: ["job-a:eval", "shared."]
        access: read

A tenant's token authenticates on HTTP exactly like ``RLPLANE_API_TOKEN``; the single
``RLPLANE_API_TOKEN`` keeps working as a full-access token. Partition names travel in URL
paths, so a prefix ends in one of the name characters (``:`` or ``.`` read well), not
``/``. Scopes hold on both data paths: over HTTP the API checks them; on the native
engine a tenant authenticates with a credential of its own (``/v1/transport`` hands it
out: derived from its token, never the token itself) and the controller checks every
request against the scope that credential carries. A scoped credential never maps a
unit's slab (the slab holds every tenant's bytes): its bytes move over the engine's
sockets. The TransferQueue-based backends have no per-request authentication at all,
so there a scoped token gets the HTTP data path only. Changing the file needs a restart.

Example::

    tenants = Tenants.load("/etc/rlplane/tokens.yaml")
    who = tenants.lookup("a-long-random-secret")     # Access(tenant='job-a', ...)
    who.check("job-a:step-0", write=True)              # fine
    who.check("job-b:step-0", write=False)             # ForbiddenError
"""

from __future__ import annotations

import hashlib
import hmac
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Optional

import yaml
from pydantic import BaseModel, Field, SecretStr, ValidationError, field_validator, model_validator

from rlplane import errors as E

#: The engine's PLAIN user name of full-access credentials (RLPLANE_API_TOKEN's, the service's own).
FULL_USER = "rlplane"


class TenantSpec(BaseModel):
    """One entry of the tokens file."""

    name: str = Field(..., pattern=r"^[A-Za-z0-9_-]{1,64}$")
    token: SecretStr = Field(..., description="At least 16 characters.")
    prefixes: list[str] = Field(..., min_length=1, max_length=64)
    access: Literal["read", "read-write"] = "read-write"

    @field_validator("token")
    @classmethod
    def _long(cls, v: SecretStr) -> SecretStr:
        token = v.get_secret_value()
        if len(token) < 16:
            raise ValueError("a token needs at least 16 characters")
        if not (token.isascii() and token.isprintable()) or " " in token:
            raise ValueError("a token is printable ASCII without spaces (what an HTTP header carries as it is)")
        return v

    @field_validator("prefixes")
    @classmethod
    def _prefixes(cls, v: list[str]) -> list[str]:
        for p in v:
            if not p or len(p) > 200 or "/" in p:
                raise ValueError(f"prefix {p!r} must be 1-200 characters of a partition name (no '/')")
        return v


class TokensFile(BaseModel):
    tokens: list[TenantSpec] = Field(..., max_length=10_000)

    @model_validator(mode="after")
    def _unique(self) -> TokensFile:
        names = [t.name for t in self.tokens]
        secrets = [t.token.get_secret_value() for t in self.tokens]
        if len(set(names)) != len(names) or FULL_USER in names:
            raise ValueError(f"tenant names must be distinct and not {FULL_USER!r}")
        if len(set(secrets)) != len(secrets):
            raise ValueError("two tenants share a token")
        return self


@dataclass(frozen=True)
class Access:
    """Who a request comes from: a tenant (its prefixes, read or read-write), or full access."""

    tenant: Optional[str] = None
    prefixes: tuple[str, ...] = ()
    write: bool = True

    @property
    def full(self) -> bool:
        return self.tenant is None

    def sees(self, partition: str) -> bool:
        """Whether ``partition`` is inside this caller's scope."""
        return self.full or partition.startswith(self.prefixes)

    def check(self, partition: str, *, write: bool) -> None:
        """ForbiddenError unless this caller may read (``write=False``) or change ``partition``."""
        if not self.sees(partition):
            raise E.ForbiddenError(f"tenant {self.tenant!r} may not touch partition {partition!r}: its token is "
                                   f"scoped to partitions starting with {list(self.prefixes)}")
        if write and not self.write:
            raise E.ForbiddenError(f"tenant {self.tenant!r} has a read-only token; it cannot change {partition!r}")

    def wire(self) -> list[Any]:
        """The scope as the engine's controller takes it: ``[prefixes, write]``."""
        return [list(self.prefixes), self.write]


FULL = Access()


class Tenants:
    """The tokens a service accepts and what each may do (see the module docstring)."""

    def __init__(self, admin_token: str | None, specs: list[TenantSpec] | None = None) -> None:
        self.admin_token = admin_token
        self.specs = list(specs or [])
        if admin_token is not None and any(hmac.compare_digest(t.token.get_secret_value().encode(),
                                                               admin_token.encode()) for t in self.specs):
            raise E.InvalidArgumentError("a tenant's token is RLPLANE_API_TOKEN, the full-access token: give the "
                                         "tenant a token of its own")
        self._by_token = [(t.token.get_secret_value().encode(), Access(t.name, tuple(t.prefixes), t.access == "read-write"))
                          for t in self.specs]

    @classmethod
    def load(cls, admin_token: str | None, path: str | None) -> Tenants:
        """The tenants of ``path`` (none when empty); InvalidArgumentError naming the file and what is wrong."""
        if not path:
            return cls(admin_token)
        try:
            text = Path(path).read_text()
            raw = yaml.safe_load(text) if not path.endswith(".json") else json.loads(text)
            return cls(admin_token, TokensFile.model_validate(raw).tokens)
        except OSError as err:
            raise E.InvalidArgumentError(f"RLPLANE_TOKENS_FILE {path}: cannot read it ({err})") from None
        except ValidationError as err:  # (its text would quote the input: a token)
            where = "; ".join(f"{'.'.join(str(x) for x in e['loc'])}: {e['msg']}"
                              for e in err.errors(include_input=False))
            raise E.InvalidArgumentError(f"RLPLANE_TOKENS_FILE {path}: {where[:500]}") from None
        except yaml.YAMLError as err:  # (where, not the line: it may hold a token)
            mark = getattr(err, "problem_mark", None)
            at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            raise E.InvalidArgumentError(f"RLPLANE_TOKENS_FILE {path}: not YAML{at} "
                                         f"({getattr(err, 'problem', None) or type(err).__name__})") from None
        except ValueError as err:  # (JSON's errors say where, never what)
            raise E.InvalidArgumentError(f"RLPLANE_TOKENS_FILE {path}: {str(err)[:500]}") from None

    @property
    def enabled(self) -> bool:
        """Whether requests need a token at all."""
        return self.admin_token is not None or bool(self.specs)

    def lookup(self, token: str | None) -> Access | None:
        """The caller a bearer token stands for, or None (no such token). Every token is
        compared (in constant time each), so the answer's timing says nothing."""
        if not self.enabled:
            return FULL
        got = (token or "").encode()
        found = FULL if self.admin_token is not None and hmac.compare_digest(got, self.admin_token.encode()) else None
        for secret, access in self._by_token:
            if hmac.compare_digest(got, secret):
                found = access
        return found

    def lookup_header(self, authorization: str | bytes) -> Access | None:
        """:meth:`lookup` of an ``Authorization: Bearer <token>`` header value."""
        value = authorization.decode("latin-1") if isinstance(authorization, bytes) else authorization
        scheme, _, token = value.partition(" ")
        if scheme.lower() != "bearer":  # (a scheme is case-insensitive, RFC 9110)
            return None if self.enabled else FULL
        return self.lookup(token.strip(" "))

    def data_users(self, store_name: str) -> dict[str, tuple[str, Access]]:
        """Each tenant's native-engine credential: user -> (secret, scope). The secret is
        an HMAC of the tenant's token and the store's name, like the full-access one."""
        out = {}
        for t in self.specs:
            secret = hmac.new(t.token.get_secret_value().encode(), f"rlplane-data:{store_name}:{t.name}".encode(),
                              hashlib.sha256).hexdigest()
            out[t.name] = (secret, Access(t.name, tuple(t.prefixes), t.access == "read-write"))
        return out


__all__ = ["Tenants", "TenantSpec", "Access", "FULL", "FULL_USER"]
