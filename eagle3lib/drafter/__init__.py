"""The EAGLE-3 drafter, as every stage sees it:

    model.py          the draft model (one Llama decoder layer over fc(aux states)), TTT forward and engine-style steps
    config.py         its shape (DrafterConfig): dims, EAGLE-3.1 norm flags, attention kind; config.json both ways
    attention.py      the layer's attention: Llama's (gqa), and the choice between it and MLA (ATTENTIONS)
    mla.py            DeepSeek's multi-head latent attention as that layer's attention (draft_attention: mla)
    ttt_attention.py  the training-time-test attention kernels: dense (reference), flex, merged (cuDNN / flash varlen)
    vocab.py          the draft vocabulary (d2t, t2d)
    layer_kinds.py    the draft layer's kind (gqa | mla) as a checkpoint sees it: architecture, config keys, tensor shapes
    formats.py        the checkpoint layouts we read (canonical, speculators, EAGLE/SpecForge) into the canonical form
    aux_ids.py        aux layer ids in each engine's convention (SGLang's rule per architecture)

`from eagle3lib.drafter import Drafter, DrafterConfig` is the model's public name.
"""

from eagle3lib.drafter.config import ARCHITECTURE, DrafterConfig
from eagle3lib.drafter.model import DraftCache, Drafter

__all__ = ["ARCHITECTURE", "DraftCache", "Drafter", "DrafterConfig"]
