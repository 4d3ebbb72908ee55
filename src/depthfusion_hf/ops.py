"""The public depth-fusion ops, one function per op, each dispatching reference / torch / triton.

The implementations live in the model folders (so that exported remote code carries them);
this module only re-exports them.
"""

from .models.attnres import attention_residual
from .models.dwa import depth_weighted_average
from .models.mhc_connection import hyper_connection, hyper_head
from .models.mhc_mix import hyper_mix
from .models.moda_attention import moda_attention

__all__ = ["attention_residual", "depth_weighted_average", "hyper_connection", "hyper_head", "hyper_mix",
           "moda_attention"]
