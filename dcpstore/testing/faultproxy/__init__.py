"""A fault-injecting HTTP/1.1 reverse proxy for reliability tests of object-store backends.

Put it in front of an S3 or GCS stand-in on 127.0.0.1 and point a backend's
``endpoint_url`` at :attr:`FaultProxy.endpoint_url`::

    with FaultProxy(server.endpoint_url, FaultPlan(rate=0.1), seed=3) as proxy:
        dcpstore.save(state, "s3://bucket/ckpt", endpoint_url=proxy.endpoint_url)
        print(proxy.stats.faults)

In front of a stand-in served over HTTPS, give the proxy a server-side ``tls`` context
(``TLSFiles.server_context()`` of :mod:`dcpstore.testing.tls`): it then serves HTTPS with
that certificate, and reaches the ``https://`` upstream trusting ``upstream_tls``. It
reads every request in the clear between the two, so it counts and faults exactly as
over plain HTTP.

Every request is forwarded unchanged (``Host`` included, so SigV4 signatures stay
valid) except those the :class:`FaultPlan` picks, which get one of these faults:

``"503"`` / ``"500"``
    An S3-style XML error (``SlowDown`` / ``InternalError``) or, for GCS JSON API paths
    (``/storage/...``, ``/upload/...``), a GCS JSON error, with a request id header. The
    upstream never sees the request.
``"reset"``
    The client connection is reset (``SO_LINGER`` 0, so the client sees ``ECONNRESET``)
    after part of the request body was read, or after all of it, before any response.
    The upstream never sees the request.
``"truncate"``
    The request *is* forwarded and processed upstream; the client gets the real status
    and headers, but the response body is cut short (for a response without a body,
    the status line is cut) and the connection closed. This is the case that matters
    for non-idempotent requests: the client cannot tell that its request succeeded.
``"delay"``
    The proxy answers only after :attr:`FaultPlan.delay_s` (longer than the client's
    timeout): the client gives up first. If it is still connected then, the request is
    forwarded and answered normally.
``stall``
    (:attr:`FaultPlan.stall`) Matching requests are accepted and never answered, until
    the client gives up or :meth:`FaultProxy.stop`.

Besides faults, the proxy can stand in for a store that serves only so many requests at
once (``max_in_flight``): the requests beyond it wait for a free slot (``over_limit=
"queue"``, a server with that many workers) or are answered ``503 SlowDown`` (``"503"``,
a store that throttles). :attr:`ProxyStats.peak_in_flight` counts the most requests a
client had open at once either way.

The proxy is a small thread-per-connection design on the standard library only. Bodies
are streamed in both directions (``Content-Length`` or chunked, never buffered whole),
connections are kept alive on both sides, and ``Expect: 100-continue`` is answered by
the proxy itself. Fault decisions come from ``random.Random(seed)``, so a run with
sequential requests is reproducible. :meth:`FaultProxy.stop` returns promptly even
while requests are stalled: it shuts every socket down.

The modules: :mod:`~dcpstore.testing.faultproxy.rules` (the plan, request kinds, the
injected errors), :mod:`~dcpstore.testing.faultproxy.stats` (the counts),
:mod:`~dcpstore.testing.faultproxy.proxy` (the server and its connections),
:mod:`~dcpstore.testing.faultproxy.exchange` (one request: decide, inject),
:mod:`~dcpstore.testing.faultproxy.forwarding` (to the upstream and back) and
:mod:`~dcpstore.testing.faultproxy.wire` (HTTP/1.1 message reading).
"""

from __future__ import annotations

from dcpstore.testing.faultproxy.proxy import FaultProxy
from dcpstore.testing.faultproxy.rules import FAULT_KINDS, FaultPlan, RequestInfo, classify
from dcpstore.testing.faultproxy.stats import FaultRecord, ProxyStats

__all__ = [
    "FAULT_KINDS",
    "FaultPlan",
    "FaultProxy",
    "FaultRecord",
    "ProxyStats",
    "RequestInfo",
    "classify",
]
