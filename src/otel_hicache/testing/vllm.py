"""A real vLLM engine on a CPU, for tests/vllm, the vLLM benchmark and trying the adapter without a GPU (README
"Instrument vLLM"); it imports neither vLLM nor torch at the top, so a driver that only starts engines stays light.

* :func:`build_model`: a tiny random Llama made offline (transformers' ``LlamaConfig``: 2 layers, hidden 64, head
  size 32 - the smallest vLLM's CPU attention takes -, vocabulary 1,000, ``save_pretrained``) with a ``tokenizers``
  WordLevel tokenizer over the words ``w0`` ... ``w996`` saved as ``tokenizer.json``;
* :func:`kv_transfer_config`: vLLM's ``OffloadingConnector`` with the out-of-tree host-copy spec of
  :mod:`otel_hicache.testing.vllm_host_copy` (vLLM's CPU spec and manager; a worker doing real torch copies between
  the engine's KV tensors and a host buffer), loaded by vLLM's own ``spec_name`` / ``spec_module_path``; or its
  tiering spec, with vLLM's filesystem tier in a folder behind the CPU tier;
* :func:`engine_arguments`: vLLM's engine arguments for that model and CPU tier;
* :func:`environment`: what vLLM's CPU build needs here (a small KV space, no thread pinning, offline, no usage
  reports) and ``PYTHONPATH`` so every vLLM process imports the spec.

``python -m otel_hicache.testing.vllm model DIR`` builds the model.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

#: The clone. It and its ``src/`` are on ``PYTHONPATH`` of every vLLM process: the tests' engine apps and the spec are
#: imported by their module paths.
ROOT = Path(__file__).resolve().parents[3]
#: Where vLLM finds the host-copy spec.
SPEC_MODULE = "otel_hicache.testing.vllm_host_copy"

#: Tokens per KV block (vLLM's CPU attention takes multiples of 32) and the tests' KV cache in blocks: 12 blocks
#: hold two requests of one prompt each, so a third evicts the first from the engine's prefix cache.
BLOCK_TOKENS = 32
GPU_BLOCKS = 12
#: One prompt of the tests: five full blocks (the engine offloads full blocks only).
PROMPT_TOKENS = 5 * BLOCK_TOKENS
#: Bytes of one block of the tiny model, every layer: 2 layers x (K, V) x 2 KV heads x 32 x 2 bytes (bfloat16) x 32
#: tokens. One CPU-tier chunk holds one block (16 KiB: already a multiple of the page size vLLM aligns chunks to).
BLOCK_BYTES = 2 * 2 * 2 * 32 * 2 * BLOCK_TOKENS
MAX_MODEL_LEN = 256
#: Distinct words of the tokenizer (``w0`` ... ``w996``), one token each.
WORDS = 997

LLAMA: dict[str, Any] = {
    "vocab_size": 1000,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "bfloat16",
}


def build_model(directory: str | os.PathLike[str]) -> Path:
    """Write the tiny model (random weights, seeded) and its tokenizer into ``directory``."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    from transformers.utils import logging as transformers_logging

    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": 3 + i for i in range(int(LLAMA["vocab_size"]) - 3)}}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    ).save_pretrained(path)
    torch.manual_seed(0)
    shown = transformers_logging.is_progress_bar_enabled()
    transformers_logging.disable_progress_bar()  # a bar for one tiny shard, in the middle of a benchmark's output
    try:
        LlamaForCausalLM(LlamaConfig(**LLAMA)).save_pretrained(path)
    finally:
        if shown:
            transformers_logging.enable_progress_bar()
    return path


def prompt(seed: int, tokens: int = PROMPT_TOKENS) -> str:
    """A prompt of exactly ``tokens`` words (one token each: no BOS is added by this tokenizer), one per seed."""
    return " ".join(f"w{(seed * 37 + i * 7) % WORDS}" for i in range(tokens))


def kv_transfer_config(cpu_chunks: int, storage_dir: str | None = None) -> dict[str, Any]:
    """vLLM's OffloadingConnector with a CPU tier of ``cpu_chunks`` chunks (one block each); with ``storage_dir``,
    vLLM's tiering with its filesystem tier there behind the CPU tier (``HostCopyTieringSpec``)."""
    extra: dict[str, Any] = {"spec_module_path": SPEC_MODULE, "cpu_bytes_to_use": cpu_chunks * BLOCK_BYTES}
    if storage_dir is None:
        extra["spec_name"] = "HostCopySpec"
    else:
        extra["spec_name"] = "HostCopyTieringSpec"
        extra["secondary_tiers"] = [{"type": "fs", "root_dir": storage_dir, "n_read_threads": 2, "n_write_threads": 2}]
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_connector_extra_config": extra}


def engine_arguments(
    model: str | os.PathLike[str],
    cpu_chunks: int,
    tp: int = 1,
    *,
    gpu_blocks: int = GPU_BLOCKS,
    max_model_len: int = MAX_MODEL_LEN,
    storage_dir: str | None = None,
) -> dict[str, Any]:
    """vLLM's engine arguments (``LLM(**...)``; the server's flags are the same names) for the tiny model, its KV
    cache ``gpu_blocks`` blocks of :data:`BLOCK_TOKENS` (``storage_dir``: see :func:`kv_transfer_config`)."""
    return {
        "model": str(model),
        "enforce_eager": True,
        "num_gpu_blocks_override": gpu_blocks,
        "block_size": BLOCK_TOKENS,
        "max_model_len": max_model_len,
        "max_num_seqs": 4,
        "seed": 0,
        "tensor_parallel_size": tp,
        "kv_transfer_config": kv_transfer_config(cpu_chunks, storage_dir),
    }


def environment(**extra: str) -> dict[str, str]:
    """The environment of a vLLM process here (``extra`` on top, e.g. the ``OTEL_*`` variables)."""
    return {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH")])),
        **extra,
    }


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m otel_hicache.testing.vllm", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("model", help="build the tiny model").add_argument("directory")
    args = parser.parse_args()
    print(build_model(args.directory))


if __name__ == "__main__":
    main()
