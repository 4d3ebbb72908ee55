"""The public depth-fusion ops, one function per op, each dispatching reference / torch / triton.

The implementations live in the model folders (so that exported remote code carries them);
this module only re-exports them.
"""

from .models.denseformer.dwa import depth_weighted_average
from .models.moda.moda_attention import moda_attention

__all__ = ["depth_weighted_average", "moda_attention"]
