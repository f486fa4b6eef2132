"""Graph passes of the ring_dilated backend, installed as ``ring_rewrite.passes``.

``pipeline.py`` lists them in the order they run. Each is ``(gm, example_inputs, *, config) -> gm``.
"""

from ._fx import location
from .decompose_mha import decompose_attention_modules
from .find_sdpa import SdpaSite, find_sdpa_sites, sdpa_unsupported_reason
from .pipeline import NORMALISING, REWRITE, Pass, check_disabled, run_passes
from .records import SiteRecord, UnsupportedSiteError
from .rewrite_sdpa import rewrite_sdpa

__all__ = [
    "NORMALISING",
    "REWRITE",
    "Pass",
    "SdpaSite",
    "SiteRecord",
    "UnsupportedSiteError",
    "check_disabled",
    "decompose_attention_modules",
    "find_sdpa_sites",
    "location",
    "rewrite_sdpa",
    "run_passes",
    "sdpa_unsupported_reason",
]
