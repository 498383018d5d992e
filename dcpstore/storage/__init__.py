"""The storage layer: the object-store contract and the framework around it.

Lowest layer of dcpstore; it knows nothing of DCP. Modules:

- :mod:`~dcpstore.storage.contract`: the public contract plugins implement
  (``ObjectStore``, ``MultipartStore``, ``StoreLimits``; re-exported by
  :mod:`dcpstore.plugin`);
- :mod:`~dcpstore.storage.store_backend`: the framework's wrapper of a plugin store;
- :mod:`~dcpstore.storage.backend`: the framework's ``Backend`` (the DCP adapter's view),
  over :mod:`~dcpstore.storage.types`, :mod:`~dcpstore.storage.lifecycle` (client, pool,
  lazy state, pickling), :mod:`~dcpstore.storage.retry` (retries and the one
  classification) and :mod:`~dcpstore.storage.reads` (concurrent scatter reads);
- :mod:`~dcpstore.storage.multipart`: concurrent part uploads with pooled buffers;
- :mod:`~dcpstore.storage.local`: the built-in POSIX store;
- :mod:`~dcpstore.storage.concurrency`, :mod:`~dcpstore.storage.clients`: adaptive limits
  and shared clients;
- :mod:`~dcpstore.storage.uri`, :mod:`~dcpstore.storage.options`,
  :mod:`~dcpstore.storage.registry`, :mod:`~dcpstore.storage.resolve`: from a URI to a
  backend, resolved once;
- :mod:`~dcpstore.storage.redact`: credentials kept out of logs and messages.
"""

from dcpstore._compat import submodule_getattr

__getattr__ = submodule_getattr(__name__)
