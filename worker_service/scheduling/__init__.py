"""Admission and dispatch of generation requests.

``admission.AdmissionQueue`` admits jobs into a bounded FIFO and cancels them; ``batching`` picks
the next batch from the queue; ``dispatcher.Dispatcher`` runs batches on the ready runners and
retries a batch whose runner died.
"""
