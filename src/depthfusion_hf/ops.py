"""The public depth-fusion ops, one function per op, each dispatching reference / torch / triton.

The implementations live in the model folders (so that exported remote code carries them);
this module only re-exports them.
"""

from .models.attnres.attnres import attention_residual
from .models.denseformer.dwa import depth_weighted_average
from .models.moda.moda_attention import moda_attention

__all__ = ["attention_residual", "depth_weighted_average", "moda_attention"]
