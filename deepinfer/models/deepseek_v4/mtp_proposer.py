"""`--speculative-config '{"method": "mtp", ...}'`: drafting with DeepSeek-V4's own MTP layer (mtp.py).

Not wired into the engine yet: speculative decoding on DeepSeek-V4 needs its compressed KV state rolled
back past rejected drafts, which the engine core refuses before a proposer is built (engine/core.py). The
pieces are in place (the layer, its checkpoint loading, the target's last streams via
`DeepseekV4ForCausalLM.keep_last_streams`); this builder states what is missing instead of guessing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from deepinfer.config import SpeculativeMethod
from deepinfer.engine.spec.proposer import Proposer
from deepinfer.models.deepseek_v4.mtp import num_mtp_layers

if TYPE_CHECKING:
    from deepinfer.engine.core import EngineCore


def build_mtp_proposer(method: SpeculativeMethod, core: EngineCore) -> Proposer:
    cfg = core.hf_config
    if getattr(cfg, "model_type", None) != "deepseek_v4" or not num_mtp_layers(cfg):
        raise ValueError('speculative method "mtp" needs a DeepSeek-V4 checkpoint with num_nextn_predict_layers > 0 '
                         f"(got model_type {getattr(cfg, 'model_type', None)!r}, "
                         f"num_nextn_predict_layers={num_mtp_layers(cfg)})")
    raise ValueError('speculative method "mtp" is not wired into the engine yet: DeepSeek-V4 speculation needs its '
                     "compressed KV rolled back past rejected drafts first")
