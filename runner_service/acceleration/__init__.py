"""Speed-ups applied to a loaded model (``InitRequest.acceleration``): a step cache whose state
belongs to each image, regional ``torch.compile``, weight quantization and an attention backend.
Each is the field's library (diffusers' hooks and dispatcher, torch.compile, torchao); the row
cache is written here only because no library keeps a cache's decision per row of a batch."""
