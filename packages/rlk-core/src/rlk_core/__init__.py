"""rlk-core: operators with one arithmetic contract for train and rollout.

Importing this package has no side effects beyond defining the ``torch.ops.rlk`` operators and
registering rlk's built-in backends: no environment reads, no CUDA initialisation, no patching.
"""

__version__ = "0.1.0"
