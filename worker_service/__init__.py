"""The diffusion worker: the public gRPC face in front of a model-runner sidecar.

It validates, queues and dispatches generation requests, encodes images and drives the model
lifecycle. It never imports torch; it starts in about a second.
"""
