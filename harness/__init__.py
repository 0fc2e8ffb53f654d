"""What the tests and the benchmarks share: real service processes (``harness.processes``) and a
GenerateStream read on a thread (``harness.streams``). Torch-free."""
