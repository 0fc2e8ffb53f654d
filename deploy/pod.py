"""The local launcher behind ``make run``: the runner and the worker, like a pod of two containers.

    python deploy/pod.py [--model shapes] [--device auto] [-- extra worker flags]

What it does is ``serving_common.pod``'s, which ``diffusion serve MODEL`` runs too.
"""

import sys

from serving_common.pod import main

if __name__ == "__main__":
    sys.exit(main())
