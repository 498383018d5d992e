"""The storage layer: the object-store contract and the framework around it.

Lowest layer of dcpstore; it knows nothing of DCP. Modules:

- :mod:`~dcpstore.storage.backend`: the framework's :class:`Backend` (retries, deadlines,
  worker pool, adaptive concurrency, client sharing, one error classification);
- :mod:`~dcpstore.storage.multipart`: concurrent part uploads with pooled buffers;
- :mod:`~dcpstore.storage.local`: the built-in POSIX backend;
- :mod:`~dcpstore.storage.concurrency`, :mod:`~dcpstore.storage.clients`: adaptive limits
  and shared clients;
- :mod:`~dcpstore.storage.uri`, :mod:`~dcpstore.storage.options`,
  :mod:`~dcpstore.storage.registry`, :mod:`~dcpstore.storage.resolve`: from a URI to a
  backend, resolved once;
- :mod:`~dcpstore.storage.redact`: credentials kept out of logs and messages.
"""

from dcpstore._compat import submodule_getattr

__getattr__ = submodule_getattr(__name__)
