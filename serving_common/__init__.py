"""What the worker, the runner and the clients share: gRPC conventions, with no torch and no SDK.

- ``protocol``: service names from the proto descriptors, the dtype table, the per-image seed rule.
- ``channels``: message size limits and channel/server options.
- ``errors``: the one error type (``ServiceError``), rich ``BadRequest`` details and the decorator
  that maps errors to status codes for every servicer.
- ``server``: an asyncio server with health and reflection, and shutdown signals.
- ``flags``: argparse with ``PREFIX_FLAG`` environment defaults.
- ``auth``: bearer tokens, server interceptor and client interceptors.
- ``logs``: text or JSON logging, request ids in metadata.
"""
