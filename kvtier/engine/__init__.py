"""Real models through kvtier: the transformers bridge (`hf`) and the request loop (`engine`)."""

from kvtier.engine.engine import Engine
from kvtier.engine.hf import spec_from_hf_config
from kvtier.engine.results import RequestResult, Update
from kvtier.engine.sampling import SamplingParams

__all__ = ["Engine", "RequestResult", "SamplingParams", "Update", "spec_from_hf_config"]
