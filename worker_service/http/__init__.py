"""The OpenAI Images API over HTTP (``--http-port``), on the same path as gRPC Generate.

- ``openai_images``: the Starlette app, its routes, tokens, metrics and cancel-on-disconnect.
- ``params``: an OpenAI request body as the ``GenerateRequest`` it stands for.
- ``edits``: an edit's multipart body (image, mask, fields) as the ``GenerateRequest`` it stands for.
- ``body``: request bodies read within their caps and the shared ``BodyBudget``.
- ``errors``: the one mapping from ServiceError codes to HTTP statuses and OpenAI error bodies.
- ``server``: uvicorn inside the worker's own event loop.
"""
