"""Integrations: dcpstore where trainers already configure their checkpoints.

Each submodule adapts one trainer's checkpoint hooks to dcpstore's public API, so that a
user changes one config value or adds one plugin object. Importing this package imports
no trainer (and no submodule); each submodule imports its trainer lazily, and no trainer
is a dependency of dcpstore.

- :mod:`dcpstore.integrations.dcp_routing`: plain ``dcp.save(checkpoint_id=uri)`` /
  ``dcp.load`` / ``dcp.async_save`` pick dcpstore (``enable()`` or
  ``DCPSTORE_DCP_ROUTING=1``). Works for any trainer that calls DCP by checkpoint id.
- :mod:`dcpstore.integrations.torchtitan`: ``DcpstoreCheckpointManager`` for torchtitan
  (``checkpoint.folder = "s3://..."``).
- :mod:`dcpstore.integrations.lightning`: PyTorch Lightning.
- :mod:`dcpstore.integrations.accelerate`: HF Accelerate (``DcpstoreAccelerator``).
- :mod:`dcpstore.integrations.transformers`: the HF Trainer (``DcpstoreTrainer``).
- :mod:`dcpstore.integrations.physicsnemo`: PhysicsNeMo's ``save_checkpoint`` /
  ``load_checkpoint`` / ``load_model_weights`` on dcpstore URIs, sharded (one import).
- :mod:`dcpstore.integrations.megatron`: Megatron-Core ``dist_checkpointing`` on dcpstore
  URIs (``DcpstoreFeature.enable()``, a feature flag in Megatron's own style).
- :mod:`dcpstore.integrations.areal`: AReaL's FSDP engine save, load and recover on
  dcpstore URIs.

See docs/integrations/ for one page per integration.
"""

from __future__ import annotations

__all__: list[str] = []
