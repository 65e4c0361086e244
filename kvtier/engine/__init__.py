"""Real models through kvtier: the transformers bridge (`hf`), the request loop (`engine`), its
scheduler, batches and sampling, and tensor-parallel ranks in lockstep (`lockstep`).

The HTTP server over an engine is `kvtier.server`; nothing here imports it or the CLI."""

from kvtier.engine.engine import Engine
from kvtier.engine.hf import spec_from_hf_config
from kvtier.engine.results import RequestResult, Update
from kvtier.engine.sampling import SamplingParams

__all__ = ["Engine", "RequestResult", "SamplingParams", "Update", "spec_from_hf_config"]
