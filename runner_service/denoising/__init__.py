"""Step-level batching: the runner owns the denoising loop of families whose loop is standard.

``prompt_cache`` keeps encoded prompts, ``loops`` has each family's pieces (encode,
start, one step for many sequences, decode), and ``engine`` admits requests into the running
batch at step boundaries and hands each its images when its own steps are done.
"""
