"""Tiny seeded checkpoints built with transformers, and transformers itself as the
correctness oracle."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import pytest
import torch

if TYPE_CHECKING:
    from kiln import Runtime

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

# Without a GPU the Triton kernels run in Triton's interpreter. It is chosen when
# a kernel is defined, so the variable must be set before kiln's kernels import.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Compiled entries of this session live in a private cache: counts of compilations
# asserted here must not depend on what an earlier run left in the user's cache.
# Where kiln's C small-batch linear kernel builds (AVX2 and FMA: kiln.compiler.cpu_linear),
# it is the CPU LM head and no head is compiled; elsewhere one is, per exact size 1, 2, 4.
CPU_LM_HEADS = 0 if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512") else 3
_SESSION_CACHE = Path(tempfile.mkdtemp(prefix="kiln-test-cache-"))
os.environ["KILN_CACHE_DIR"] = str(_SESSION_CACHE)

def cpu_flags() -> set[str]:
    """The CPU's feature flags as /proc/cpuinfo lists them (empty elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    except OSError:
        return set()


# Every build of kiln's C kernels this CPU runs, as (name, flags after
# kiln.native.FLAGS): the native one, and the narrower code a CPU without
# AVX512-BF16, or without AVX-512, gets.
KERNEL_BUILDS: list[tuple[str, tuple[str, ...]]] = [("native", ())]
if {"avx512f", "avx512_bf16"} <= cpu_flags():
    KERNEL_BUILDS.append(("no-bf16-dot", ("-mno-avx512bf16", "-mno-avx512vnni")))
if "avx512f" in cpu_flags():
    KERNEL_BUILDS.append(("avx2", ("-mno-avx512f",)))


ARCH_CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
}

BASE = dict(
    vocab_size=384,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    initializer_range=0.2,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)


def load_eager(path: Any, **kwargs: Any) -> "Runtime":
    """Runtime.load at -O0: the runtime tests need no compiler (tests/test_compiler.py has it)."""
    from kiln import Runtime

    kwargs.setdefault("optimization_level", 0)
    return Runtime.load(path, **kwargs)


def build_hf_model(family: str, seed: int = 0, **overrides: Any) -> torch.nn.Module:
    import transformers

    config_cls, model_cls = (getattr(transformers, n) for n in ARCH_CLASSES[family])
    kwargs = {**BASE, **overrides}
    config = config_cls(**kwargs)
    config.architectures = [model_cls.__name__]
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    # transformers initialises biases to zero and norms to one; random values make
    # a loader that drops or swaps them fail the comparison.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.2)
            elif "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def save_checkpoint(
    model: torch.nn.Module,
    path: Path,
    *,
    legacy_rope: bool = False,
    max_shard_size: str | None = None,
    dtype: torch.dtype | None = None,
) -> Path:
    """Save ``model`` as a HF checkpoint; with ``legacy_rope`` the RoPE settings
    are rewritten in the pre-transformers-5 spelling (rope_theta / rope_scaling)."""
    kwargs: dict[str, Any] = {}
    if max_shard_size:
        kwargs["max_shard_size"] = max_shard_size
    if dtype is not None:
        model = model.to(dtype)
    model.save_pretrained(str(path), **kwargs)
    if dtype is not None:
        model.float()
    if legacy_rope:
        cfg_path = path / "config.json"
        cfg = json.loads(cfg_path.read_text())
        params = dict(cfg.pop("rope_parameters"))
        cfg["rope_theta"] = params.pop("rope_theta")
        if params.get("rope_type", "default") != "default":
            params["type"] = params.pop("rope_type")
            cfg["rope_scaling"] = params
        cfg_path.write_text(json.dumps(cfg, indent=2))
    return path


@torch.no_grad()
def hf_greedy(model: torch.nn.Module, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy continuation by full forward passes: the reference kiln must match."""
    ids = list(prompt)
    out = []
    for _ in range(max_tokens):
        logits = model(torch.tensor([ids])).logits[0, -1]
        tok = int(logits.float().argmax())
        out.append(tok)
        ids.append(tok)
    return out


def random_prompts(n: int, lengths: list[int], vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (lengths[i % len(lengths)],), generator=g).tolist() for i in range(n)]


@pytest.fixture(scope="session")
def f32_kernel_library(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The C linear kernel's library built for fp32 alone, as an fp32 model's
    entry builds it: once a session, for every module that loads it (gcc
    takes seconds for it)."""
    from kiln.compiler import cpu_linear

    root = tmp_path_factory.mktemp("inductor-f32")
    return root / cpu_linear.build(root, {"f32"})


@pytest.fixture(scope="session")
def llama_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    """One small Llama shared by the scheduler, sampler and error tests."""
    model = build_hf_model("llama")
    path = save_checkpoint(model, tmp_path_factory.mktemp("llama"))
    return path, model


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[list[int]], list[list[int]]]:
    """A very small Qwen2 (fast to compile), two prompts, and their -O0 greedy tokens."""
    from kiln import Runtime, SamplingParams

    model = build_hf_model("qwen2", seed=21, num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                           num_attention_heads=2, num_key_value_heads=1)
    path = save_checkpoint(model, tmp_path_factory.mktemp("tiny"))
    prompts = random_prompts(2, [5, 9], model.config.vocab_size, seed=6)
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    eager = Runtime.load(path, optimization_level=0).generate(prompts, greedy)
    return path, prompts, [o.token_ids for o in eager]


@pytest.fixture(scope="session")
def demo_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo model (built once per session in a private cache dir)."""
    from kiln.checkpoint.demo import ensure_random_model

    return ensure_random_model(tmp_path_factory.mktemp("kiln-cache"))


class RerunGraphs:
    """CPU stand-in for torch.cuda graphs: a "capture" keeps the callable and the
    tensors it was called with, a "replay" calls it again on those same tensors
    and copies the result into the captured output. That keeps what matters
    about a real graph (it reads the inputs it was captured with, and hands back
    the captured output tensors); it cannot show that kernels avoid host-side
    values, which only a GPU can."""

    captures_live_steps = False  # captured at load, as CUDA graphs are

    def __init__(self) -> None:
        self.captures = 0
        self.replays = 0

    def new_pool(self) -> object:
        return object()

    def capture(self, fn: Callable[[], Any], pool: object) -> tuple[Any, Any]:
        self.captures += 1
        out = fn()
        return (fn, out), out

    def replay(self, graph: Any) -> None:
        self.replays += 1
        fn, out = graph
        _copy_into(out, fn())


def _copy_into(dst: Any, src: Any) -> None:
    if isinstance(dst, torch.Tensor):
        dst.copy_(src)
    elif isinstance(dst, (tuple, list)):
        for d, s in zip(dst, src):
            _copy_into(d, s)


# ----------------------------------------------------------------- child processes
CHILD = r"""
import json, sys
from kiln import Runtime, SamplingParams
rt = Runtime.load(sys.argv[1], **json.loads(sys.argv[2]))
out = rt.generate(json.loads(sys.argv[3]), SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
r = rt.startup_report
keys = ("dynamo_traces", "inductor_compiles", "artifacts_loaded", "compile_cache", "kernels_rebuilt",
        "attention_kernel", "linear_kernel", "artifact_loader", "phases")
print(json.dumps({"tokens": [o.token_ids for o in out], **{k: r[k] for k in keys},
                  "compiler_imported": sorted(m for m in ("torch._dynamo", "torch._inductor") if m in sys.modules)}))
"""


def fresh_env(root: Path, failing_compilers_log: Path | None = None, **extra: str) -> dict[str, str]:
    """The environment of a machine that never ran kiln or Inductor: HOME, TMPDIR,
    XDG_CACHE_HOME and TORCHINDUCTOR_CACHE_DIR in new empty directories under
    ``root``. With ``failing_compilers_log``, C and C++ compilers on PATH (and
    CC, CXX) log every call there and fail it."""
    env = dict(os.environ)
    for name in ("HOME", "TMPDIR", "XDG_CACHE_HOME", "TORCHINDUCTOR_CACHE_DIR"):
        (root / name.lower()).mkdir(parents=True, exist_ok=True)
        env[name] = str(root / name.lower())
    env.pop("TRITON_CACHE_DIR", None)
    if failing_compilers_log is not None:
        shims = root / "shims"
        shims.mkdir(exist_ok=True)
        for name in ("gcc", "g++", "cc", "c++", "clang", "clang++"):
            shim = shims / name
            shim.write_text(f'#!/bin/sh\necho "{name} $*" >> "{failing_compilers_log}"\nexit 1\n')
            shim.chmod(0o755)
        env.update(PATH=f"{shims}{os.pathsep}{env['PATH']}", CC=str(shims / "gcc"), CXX=str(shims / "g++"))
    env.update(extra)
    return env


def run_child(target: Path | str, load: dict[str, Any], prompts: list[list[int]], env: dict[str, str] | None = None,
              read_only: tuple[Path, Path] | None = None) -> dict[str, Any]:
    """Load ``target`` in a new process, generate 6 greedy tokens per prompt,
    and return the tokens and the startup report's counts. ``read_only``:
    (directory, mount point): the directory is bind-mounted read-only at the
    mount point first, in a private mount namespace (root ignores file modes)."""
    argv = [sys.executable, "-c", CHILD, str(target), json.dumps(load), json.dumps(prompts)]
    if read_only is not None:
        src, mount = read_only
        mount.mkdir(parents=True, exist_ok=True)
        quoted = " ".join(f"'{a}'" for a in argv)
        argv = ["unshare", "-m", "sh", "-c", f'mount --bind -o ro "{src}" "{mount}" && exec {quoted}']
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["stderr"] = proc.stderr
    return result


def kiln_cli(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kiln", *args], capture_output=True, text=True,
                          env=env or dict(os.environ), timeout=900)
