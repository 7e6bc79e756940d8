"""BlockPilot: adaptive-block speculative decoding with DFlash drafters.

The library is plain PyTorch + transformers and never imports Ray, so a machine with only torch
can generate, sweep and benchmark. Importing it does no work: models load when asked.
"""

__version__ = "0.1.0"
