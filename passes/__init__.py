"""Graph passes of the ring_dilated backend, installed as ``ring_rewrite.passes``.

Each pass is ``(gm, example_inputs, *, config) -> gm``.
"""

from ._fx import location
from .decompose_mha import decompose_attention_modules
from .find_sdpa import SdpaSite, find_sdpa_sites, unsupported_reason
from .rewrite_sdpa import SiteRecord, UnsupportedSiteError, rewrite_sdpa

__all__ = [
    "SdpaSite",
    "SiteRecord",
    "UnsupportedSiteError",
    "decompose_attention_modules",
    "find_sdpa_sites",
    "location",
    "rewrite_sdpa",
    "unsupported_reason",
]
