"""Imported by the fork servers of the demo's and the bench's worker processes (their
``set_forkserver_preload``): loads rlplane's compiled row copies there once, so every
worker forked from the server has them (else each paid ~0.4 s in its first big put or
read). Where they cannot load, nothing fails: the workers keep the numpy path, as
:func:`rlplane.rowkernels.ready` says.

Example: ``ctx.set_forkserver_preload([__name__, "rlplane_tools.preloaded"])``.
"""

from __future__ import annotations

from rlplane import rowkernels

rowkernels.ready()
