"""Azure Blob Storage backend for dcpstore: ``az://container/prefix`` (see
``docs/backends/azure.md``)."""

from dcpstore_azure.store import AzureBlobStore, AzureOptions

__all__ = ["AzureBlobStore", "AzureOptions"]
