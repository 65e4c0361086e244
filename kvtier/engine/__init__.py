"""Real models through kvtier: the transformers bridge (`hf`) and the request loop (`engine`)."""

from kvtier.engine.engine import Engine, RequestResult, SamplingParams
from kvtier.engine.hf import KVTierCache, spec_from_hf_config

__all__ = ["Engine", "KVTierCache", "RequestResult", "SamplingParams", "spec_from_hf_config"]
