"""RAT+ (decaying memory over keys and values) as a transformers model: config, modeling, Auto registration.

Importing this package registers ``model_type = "kvstash_rat"`` with transformers' Auto classes, so
``AutoModelForCausalLM.from_pretrained(dir)`` loads such a checkpoint from local code (no
``trust_remote_code``, nothing fetched).
"""

from workers.ratplus.config import RatConfig
from workers.ratplus.modeling import (
    MEMORY_KWARG,
    MemorySegments,
    RatForCausalLM,
    RatModel,
    has_decaying_memory,
    memory_gates,
    register_rat,
    set_memory_cap_scale,
)

register_rat()

__all__ = ["MEMORY_KWARG", "MemorySegments", "RatConfig", "RatForCausalLM", "RatModel", "has_decaying_memory",
           "memory_gates", "register_rat", "set_memory_cap_scale"]
